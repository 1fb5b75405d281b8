"""A multi-turn search agent written for slime, trained by streamrl with only its imports changed.

The model answers a question in turns; after each turn the text between `<search>` and
`</search>` (or, when there is none, the turn itself) is looked up in a small local
index, and the result comes back as `<information>...</information>`: tool output, so its
tokens are appended with loss mask 0. The episode ends at `<answer>` or after
`args.search_max_turns` model turns (a flag of this script: rollout.generate_kwargs.args).

Under slime the imports were

    from slime.rollout.sglang_rollout import GenerateState
    from slime.utils.http_utils import post
    from slime.utils.types import Sample
"""

from __future__ import annotations

import re

from streamrl.compat.slime import GenerateState, Sample, post

INDEX = {
    "paris": "Paris is the capital of France.",
    "seven": "Seven is the number after six.",
    "sum": "A sum is the result of adding numbers together.",
    "product": "A product is the result of multiplying numbers together.",
}


def search(query: str, top_k: int) -> str:
    """The documents whose key occurs in the query (at most `top_k`), or a miss."""
    words = set(re.findall(r"[a-z]+", query.lower()))
    hits = [text for key, text in INDEX.items() if key in words][:top_k]
    return " ".join(hits) if hits else "No results."


def query_of(text: str) -> str:
    found = re.search(r"<search>(.*?)</search>", text, re.S)
    return found.group(1) if found else text[-200:]


async def generate(args, sample: Sample, sampling_params: dict) -> Sample:
    state = GenerateState(args)
    url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate"
    sample.tokens = state.tokenizer(sample.prompt, add_special_tokens=False)["input_ids"]
    for turn in range(args.search_max_turns):
        payload = {
            "input_ids": sample.tokens,
            "sampling_params": sampling_params,
            "return_logprob": True,
        }
        output = await post(url, payload)
        meta = output["meta_info"]
        if meta["finish_reason"]["type"] == "abort":
            sample.status = Sample.Status.ABORTED
            return sample
        pairs = meta["output_token_logprobs"]
        sample.append_response_tokens(
            args,
            tokens=[token for _, token, _ in pairs],
            log_probs=[logprob for logprob, _, _ in pairs],
            meta_info=meta,
            text=output["text"],
        )
        if "<answer>" in output["text"] or turn + 1 == args.search_max_turns:
            break
        information = f"\n\n<information>{search(query_of(output['text']), args.search_topk)}</information>\n\n"
        tool_tokens = state.tokenizer(information, add_special_tokens=False)["input_ids"]
        sample.append_response_tokens(args, tokens=tool_tokens, trainable=False, text=information)
    sample.metadata["search_turns"] = turn + 1
    return sample
