"""Functions written the way slime users write them, for tests/compat/test_compat_slime.py.

Only the imports differ from slime code: `streamrl.compat.slime` instead of
`slime.utils.types`, `slime.utils.http_utils` and `slime.rollout.sglang_rollout`.
`TurnTool` is the same tool as a streamrl `Environment`, for the native path.
"""

from __future__ import annotations

import httpx

from streamrl.agents.env import StepResult
from streamrl.compat.slime import GenerateState, Sample, post

OBSERVATION = "Tool result {turn}: nothing found."


async def set_engine_version(engine_url: str, model_dir: str, version: int) -> None:
    """Reload the engine's (same) weights under a new version, as a trainer's push would."""
    body = {"model_path": model_dir, "weight_version": str(version)}
    async with httpx.AsyncClient(timeout=60) as http:
        (await http.post(f"{engine_url}/update_weights_from_disk", json=body)).raise_for_status()


def append_output(args, sample: Sample, output: dict) -> list[int]:
    """An engine answer's tokens and log-probabilities added to the sample's response (the
    model's, trained); returns the tokens."""
    pairs = output["meta_info"]["output_token_logprobs"]
    tokens = [token for _, token, _ in pairs]
    sample.append_response_tokens(
        args,
        tokens=tokens,
        log_probs=[logprob for logprob, _, _ in pairs],
        meta_info=output["meta_info"],
        text=output["text"],
    )
    return tokens


async def single_turn(args, sample: Sample, sampling_params: dict) -> Sample:
    """One model turn, in the shape of slime's default generate function."""
    state = GenerateState(args)
    url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate"
    prompt_ids = state.tokenizer(sample.prompt, add_special_tokens=False)["input_ids"]
    payload = {"input_ids": prompt_ids, "sampling_params": sampling_params, "return_logprob": True}
    output = await post(url, payload)
    pairs = output["meta_info"]["output_token_logprobs"]
    sample.tokens = prompt_ids + [token for _, token, _ in pairs]
    sample.response_length = len(pairs)
    sample.rollout_log_probs = [logprob for logprob, _, _ in pairs]
    sample.response = output["text"]
    sample.update_from_meta_info(args, output["meta_info"])
    return sample


async def tool_turns(args, sample: Sample, sampling_params: dict) -> Sample:
    """A multi-turn tool loop: model turn, tool output (loss mask 0), model turn, ...

    The tool output is one ChatML user turn after the model's: the part of `<|im_end|>\\n`
    the model did not write, the user header, the result, the assistant header. The tool
    moves the engine to a new weight version (`args.engine_url`) before the next turn."""
    state = GenerateState(args)
    tokenizer = state.tokenizer
    url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate"
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    sample.tokens = tokenizer(sample.prompt, add_special_tokens=False)["input_ids"]
    for turn in range(args.max_turns):
        payload = {
            "input_ids": sample.tokens,
            "sampling_params": sampling_params,
            "return_logprob": True,
        }
        output = await post(url, payload)
        if output["meta_info"]["finish_reason"]["type"] == "abort":
            sample.status = Sample.Status.ABORTED
            return sample
        ids = append_output(args, sample, output)
        if turn + 1 == args.max_turns:
            break
        if args.engine_url:
            await set_engine_version(args.engine_url, args.model_dir, turn + 1)
        closing = "\n" if ids and ids[-1] == im_end else "<|im_end|>\n"
        text = (
            f"{closing}<|im_start|>user\n{OBSERVATION.format(turn=turn + 1)}<|im_end|>\n"
            "<|im_start|>assistant\n"
        )
        observation = tokenizer(text, add_special_tokens=False)["input_ids"]
        sample.append_response_tokens(args, tokens=observation, trainable=False, text=text)
    return sample


async def text_payload(args, sample: Sample, sampling_params: dict) -> Sample:
    """Sends the prompt as text (the engine encodes it) and keeps the output token ids."""
    state = GenerateState(args)
    url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate"
    payload = {"text": sample.prompt, "sampling_params": sampling_params, "return_logprob": True}
    output = await post(url, payload)
    sample.tokens = state.tokenizer(sample.prompt, add_special_tokens=False)["input_ids"]
    append_output(args, sample, output)
    return sample


async def retokenized(args, sample: Sample, sampling_params: dict) -> Sample:
    """Keeps the engine's text and tokenizes it again (without return_logprob)."""
    state = GenerateState(args)
    url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate"
    output = await post(url, {"text": sample.prompt, "sampling_params": sampling_params})
    prompt_ids = state.tokenizer(sample.prompt, add_special_tokens=False)["input_ids"]
    response_ids = state.tokenizer(output["text"], add_special_tokens=False)["input_ids"]
    sample.tokens = prompt_ids + response_ids
    sample.response_length = len(response_ids)
    sample.response = output["text"]
    sample.status = Sample.Status.COMPLETED
    return sample


async def batch_generate(args, samples: list[Sample], evaluation: bool = False) -> list[Sample]:
    """The batch form: the whole group in one call of the function, one request per sample."""
    state = GenerateState(args)
    url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate"
    for sample in samples:
        sample.tokens = state.tokenizer(sample.prompt, add_special_tokens=False)["input_ids"]
        payload = {
            "input_ids": sample.tokens,
            "sampling_params": state.sampling_params,
            "return_logprob": True,
        }
        output = await post(url, payload)
        append_output(args, sample, output)
        sample.metadata["evaluation"] = evaluation
    return samples


async def gives_up(args, sample: Sample, sampling_params: dict) -> Sample:
    sample.status = Sample.Status.ABORTED
    return sample


async def response_length_reward(args, sample: Sample, **kwargs) -> float:
    """A slime reward function: the trained share of the response."""
    return sample.effective_response_length / max(sample.response_length, 1)


async def rank_in_group(args, samples: list[Sample], **kwargs) -> list[float]:
    """A slime group reward (--group-rm): each sample's index in its group."""
    return [float(i) for i, _ in enumerate(samples)]


async def failing_reward(args, sample: Sample, **kwargs) -> float:
    raise RuntimeError("the verifier is down")


class TurnTool:
    """`tool_turns`'s tool as a streamrl `Environment`: the same observation, the same
    version moves, for the native multi-turn loop."""

    def __init__(self, engine_url: str = "", model_dir: str = "", max_turns: int = 3) -> None:
        self.engine_url, self.model_dir, self.max_turns = engine_url, model_dir, max_turns
        self.turn = 0

    async def reset(self, prompt) -> str:
        return prompt.text

    async def step(self, action: str) -> StepResult:
        self.turn += 1
        if self.engine_url and self.turn < self.max_turns:
            await set_engine_version(self.engine_url, self.model_dir, self.turn)
        return StepResult(observation=OBSERVATION.format(turn=self.turn))
