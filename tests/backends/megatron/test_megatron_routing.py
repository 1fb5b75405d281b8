"""MoE routing replay ("R3") from the embedded engine to the Megatron learner, on CPU.

The wire pieces are checked in process. The end-to-end test starts a real
embedded engine (`streamrl engine serve`, transformers runner) on a tiny
Qwen3-MoE, asks it over HTTP for samples with `return_routed_experts`, and
hands them to the megatron learner in a real gloo process (this file as a
script). The learner's router weights are perturbed, as a trained learner's
would be against a stale engine: without replay its router picks other experts
for some tokens; with replay its MoE layers use the engine's experts for every
token the engine reported.
"""

from __future__ import annotations

import base64
from pathlib import Path

import numpy as np
import pytest
import torch
from megatron_ranks import worker_main

from streamrl.backends.batching import pack_micro_batches
from streamrl.fleet.results import parse_result
from streamrl.types import Group, Sample, make_decoder, make_encoder

# One worker forks every rank of this room (conftest.py of this room says why).
pytestmark = pytest.mark.xdist_group("megatron")

MODEL = "qwen3-moe-tiny"  # 2 layers, 8 experts, top-2
RUN_TIMEOUT_S = 240.0


# ---------------------------------------------------------------- the wire


def _payload(routed: np.ndarray | None, prompt_tokens: int, output_ids: list[int]) -> dict:
    meta = {"prompt_tokens": prompt_tokens, "finish_reason": {"type": "length"}}
    if routed is not None:
        meta["routed_experts"] = base64.b64encode(routed.astype("<i4").tobytes()).decode()
    return {"text": "", "output_ids": output_ids, "meta_info": meta}


def test_sglangs_routed_experts_field_becomes_one_row_per_fed_token():
    routed = np.arange(6 * 4).reshape(6, 2, 2)  # 4 prompt + 3 output tokens - 1 = 6 rows
    result = parse_result(_payload(routed, 4, [7, 8, 9]))
    assert result.routed_experts.shape == (6, 4)
    assert result.routed_experts[5].tolist() == [20, 21, 22, 23]
    assert parse_result(_payload(None, 4, [7, 8, 9])).routed_experts is None
    with pytest.raises(ValueError, match=r"meta_info\.routed_experts"):
        parse_result(_payload(np.arange(7), 4, [7, 8, 9]))


def _sample(num_prompt: int, num_response: int, routed: np.ndarray | None) -> Sample:
    return Sample(
        prompt_ids=list(range(1, num_prompt + 1)),
        response_ids=list(range(50, 50 + num_response)),
        logprobs=[-1.0] * num_response,
        versions=[1] * num_response,
        loss_mask=[1] * num_response,
        routed_experts=routed,
    )


def test_routed_experts_keep_their_rows_across_the_stream_codec():
    routed = np.arange(5 * 4, dtype=np.int16).reshape(5, 4)
    group = Group(group_id="g", prompt_seq=0, prompt_index=0, samples=[_sample(3, 3, routed)])
    decoded = make_decoder(Group).decode(make_encoder().encode(group)).samples[0]
    assert decoded.routed_experts.dtype == np.int16 and np.array_equal(
        decoded.routed_experts, routed
    )
    with pytest.raises(ValueError, match="routed_experts"):
        _sample(3, 3, np.zeros((4, 4)))


def test_micro_batches_carry_routed_experts_aligned_to_tokens_with_minus_one_elsewhere():
    samples = [
        _sample(3, 4, np.full((6, 4), 5, dtype=np.int16)),
        _sample(2, 2, None),
    ]
    (micro_batch,) = pack_micro_batches(samples, [0, 1], token_budget=64, pad_id=0)
    routed = micro_batch.extras["routed_experts"]
    assert routed.shape == (2, 7, 4) and routed.dtype == torch.int16
    first = micro_batch.sample_indices.index(0)
    assert (routed[first, :6] == 5).all() and (routed[first, 6] == -1).all()
    assert (routed[1 - first] == -1).all()
    plain = pack_micro_batches([_sample(2, 2, None)], [0], token_budget=64, pad_id=0)
    assert "routed_experts" not in plain[0].extras


def test_a_resumed_turn_keeps_the_routing_of_its_last_engine_call():
    from streamrl.agents.api import Completion, Trajectory

    completion = Completion()
    aborted = parse_result(_payload(np.zeros((4, 4)), 3, [7, 8]))
    completion.extend(aborted, [0] * len(aborted.output_ids), is_exact=True)
    resumed = parse_result(_payload(np.ones((6, 4)), 5, [9, 10]))  # the resumed call
    completion.extend(resumed, [1] * len(resumed.output_ids), is_exact=True)
    trajectory = Trajectory()
    trajectory.add_completion(completion)
    assert trajectory.routed_experts.shape == (6, 4) and (trajectory.routed_experts == 1).all()


# ---------------------------------------------------------------- learner worker (script)


def _learner_worker(out: Path, model_dir: str, samples_path: str) -> None:
    from streamrl.backends.megatron.backend import MegatronBackend
    from streamrl.backends.megatron.routing import control_of
    from streamrl.config import AlgorithmConfig, LearnerConfig

    samples = make_decoder(list[Sample]).decode(Path(samples_path).read_bytes())
    batches = pack_micro_batches(samples, list(range(len(samples))), token_budget=512, pad_id=0)

    def loss(micro_batch, logprobs, entropy):
        value = -(logprobs * micro_batch.loss_mask).sum() / micro_batch.num_tokens_in_mini_batch
        return value, {"nll": value.detach()}

    results = {}
    for replay in (False, True):
        backend = MegatronBackend(
            model_dir, LearnerConfig(backend="megatron", lr=1e-4),
            algorithm_cfg=AlgorithmConfig(routing_replay=replay), seed=0,
        )  # fmt: skip
        control = control_of(backend.model)
        control.record = True
        used = []
        for micro_batch in batches:  # one forward per micro-batch, recording each layer's experts
            logprobs = backend.compute_logprobs([micro_batch], temperature=1.0)[0]
            used.append({layer.layer: layer.used for layer in control.layers})
            used[-1]["logprobs"] = logprobs
        step = backend.train_mini_batch(batches, loss, temperature=1.0, need_entropy=False)
        results[replay] = {"used": used, "step": step}
    torch.save({"results": results, "batches": batches}, out)


# ---------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def replay_run(rank_runs, tmp_path_factory):
    """Samples from a live engine; the learner (router perturbed) without and with replay."""
    import anyio
    from engine_helpers import running_engines

    from streamrl.fleet.client import EngineClient
    from streamrl.models import build_random_model, save_random_model

    root = tmp_path_factory.mktemp("routing")
    engine_dir, learner_dir = root / "engine-model", root / "learner-model"
    save_random_model(MODEL, engine_dir, seed=0)
    learner = build_random_model(MODEL, seed=0)
    generator = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for name, parameter in learner.named_parameters():
            if name.endswith("mlp.gate.weight"):
                parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.05)
    learner.save_pretrained(learner_dir)

    prompts = [[100 + 7 * i + j for j in range(4 + i)] for i in range(6)]

    async def sample_all(url: str) -> list:
        async with EngineClient(url) as client:
            params = {"max_new_tokens": 8, "temperature": 1.0, "ignore_eos": True}
            return [
                await client.generate(prompt, params, return_routed_experts=True)
                for prompt in prompts
            ]

    with running_engines(str(engine_dir), root) as (engine,):
        results = anyio.run(sample_all, engine.url)
    samples = [
        Sample(
            prompt_ids=prompt,
            response_ids=result.output_ids,
            logprobs=result.logprobs,
            versions=result.versions,
            loss_mask=[1] * len(result.output_ids),
            routed_experts=result.routed_experts,
        )
        for prompt, result in zip(prompts, results, strict=True)
    ]
    samples_path = root / "samples.msgpack"
    samples_path.write_bytes(make_encoder().encode(samples))
    rank_runs.start("learner", 1, str(learner_dir), str(samples_path), timeout_s=RUN_TIMEOUT_S)
    return {"samples": samples, **rank_runs("learner")}


def _engine_experts(micro_batch, layer: int) -> torch.Tensor:
    """[tokens, k] in Megatron's token order ([seq, batch] flattened), -1 rows unknown."""
    routed = micro_batch.extras["routed_experts"].long()
    rows, length, _ = routed.shape
    table = routed.view(rows, length, -1, 2)[:, :, layer].transpose(0, 1)
    return table.reshape(-1, 2)


def _disagreeing_tokens(run: dict, replay: bool) -> tuple[int, int]:
    """(tokens whose learner experts differ from the engine's, tokens the engine reported)."""
    differ = reported = 0
    for micro_batch, used in zip(run["batches"], run["results"][replay]["used"], strict=True):
        for layer in (0, 1):
            engine = _engine_experts(micro_batch, layer)
            known = (engine >= 0).all(-1)
            same = engine.sort(-1).values == used[layer].sort(-1).values
            differ += int((~same.all(-1) & known).sum())
            reported += int(known.sum())
    return differ, reported


def test_the_engine_reports_the_experts_of_every_token_it_fed(replay_run):
    for sample in replay_run["samples"]:
        rows = len(sample.prompt_ids) + len(sample.response_ids) - 1
        assert sample.routed_experts.shape == (rows, 2 * 2)  # layers x top-2
        assert ((sample.routed_experts >= 0) & (sample.routed_experts < 8)).all()


def test_with_replay_the_learners_experts_are_the_engines_for_every_token(replay_run):
    differ_without, reported = _disagreeing_tokens(replay_run, replay=False)
    differ_with, _ = _disagreeing_tokens(replay_run, replay=True)
    assert reported > 100
    assert differ_without > 0, "the perturbed router should disagree somewhere"
    assert differ_with == 0


def test_agreement_and_replayed_share_are_reported_by_the_training_step(replay_run):
    without = replay_run["results"][False]["step"]
    with_replay = replay_run["results"][True]["step"]
    # The learner's own router, against the engine's choice, in both runs (with replay the
    # later layers see other inputs, so the figure moves a little).
    for step in (without, with_replay):
        assert 0.5 < step["moe_router_agreement"] < 1.0
    assert without["moe_replayed_fraction"] == 0.0
    # every real token but each row's last is replayed; padding and last tokens are not
    assert 0.5 < with_replay["moe_replayed_fraction"] < 1.0


def test_replay_brings_the_learners_logprobs_closer_to_the_engines(replay_run):
    def mean_abs_gap(replay: bool) -> float:
        gaps = []
        samples = replay_run["samples"]
        for micro_batch, used in zip(
            replay_run["batches"], replay_run["results"][replay]["used"], strict=True
        ):
            for row, index in enumerate(micro_batch.sample_indices):
                start = len(samples[index].prompt_ids)
                end = start + len(samples[index].response_ids)
                learner = used["logprobs"][row, start:end]
                gaps.append((learner - torch.tensor(samples[index].logprobs)).abs())
        return float(torch.cat(gaps).mean())

    assert mean_abs_gap(True) < mean_abs_gap(False)


if __name__ == "__main__":
    worker_main(learner=_learner_worker)
