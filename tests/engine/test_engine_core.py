"""The embedded engine's generation core on CPU, with tiny random models.

The acceptance property of the project: every logprob the engine returns equals
a teacher-forced transformers forward of the same weights over prompt + output
(fp32 CPU, max abs diff <= 1e-4), through batching, retraction and updates.
"""

from __future__ import annotations

import asyncio
import contextlib

import pytest

torch = pytest.importorskip("torch")

from streamrl import models  # noqa: E402
from streamrl.engine.core import EngineCore, Output, Request, SamplingParams  # noqa: E402
from streamrl.engine.options import EngineOptions  # noqa: E402

pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("one_torch_thread")]
TOLERANCE = 1e-4


@contextlib.contextmanager
def running_engine(model_path: str, **kwargs):
    kwargs.setdefault("max_batch_size", 4)
    kwargs.setdefault("max_seq_len", 256)
    engine = EngineCore(EngineOptions(model=model_path, **kwargs))
    engine.start()
    try:
        yield engine
    finally:
        engine.shutdown()


def prompts(count: int, *, base: int = 100) -> list[list[int]]:
    """Distinct prompts of varying lengths (3..12 tokens)."""
    return [[base + 7 * i + j for j in range(3 + (i * 5) % 10)] for i in range(count)]


def reference_logprobs(model, prompt: list[int], output: list[int], temperature: float = 1.0):
    """Teacher-forced logprobs of ``output`` after ``prompt`` under ``model`` (fp32)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0].float()
    scale = temperature if temperature > 0 else 1.0
    log_probs = torch.log_softmax(logits / scale, dim=-1)
    positions = torch.arange(len(prompt) - 1, len(prompt) + len(output) - 1)
    return log_probs[positions, torch.tensor(output)]


def max_logprob_error(
    model, requests: list[Request], outputs: list[Output], temperature=1.0
) -> float:
    worst = 0.0
    for request, output in zip(requests, outputs, strict=True):
        assert len(output.logprobs) == len(output.output_ids) == len(output.versions)
        expected = reference_logprobs(model, request.input_ids, output.output_ids, temperature)
        worst = max(worst, (expected - torch.tensor(output.logprobs)).abs().max().item())
    return worst


def requests_for(token_lists, **params) -> list[Request]:
    return [Request(f"r{i}", ids, SamplingParams(**params)) for i, ids in enumerate(token_lists)]


@pytest.fixture(params=["qwen3", "llama", "qwen2"])
def compact_model_path(request, tiny_model_dir, tiny_llama_dir) -> str:
    return {"qwen3": tiny_model_dir, "llama": tiny_llama_dir, "qwen2": "random:qwen2-tiny"}[
        request.param
    ]


# -- logprobs and greedy outputs --------------------------------------------------


@pytest.mark.parametrize("temperature", [1.0, 0.7])
async def test_compact_logprobs_equal_a_teacher_forced_transformers_forward(
    compact_model_path, temperature
):
    """Seven requests of different lengths in four slots: slots are refilled and compacted."""
    lengths = [12, 5, 9, 3, 14, 7, 10]
    requests = [
        Request(
            f"r{i}", ids, SamplingParams(max_new_tokens=n, temperature=temperature, ignore_eos=True)
        )
        for i, (ids, n) in enumerate(zip(prompts(7), lengths, strict=True))
    ]
    with running_engine(compact_model_path) as engine:
        assert engine.model_info["runner"] == "compact"
        outputs = await engine.generate(requests)
    reference = models.load_causal_lm(compact_model_path)
    assert max_logprob_error(reference, requests, outputs, temperature) <= TOLERANCE
    assert [o.finish_reason for o in outputs] == [{"type": "length", "length": n} for n in lengths]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
async def test_hf_runner_logprobs_equal_a_teacher_forced_forward(tiny_model_dir, temperature):
    requests = requests_for(prompts(6), max_new_tokens=8, temperature=temperature, ignore_eos=True)
    with running_engine(tiny_model_dir, runner="hf") as engine:
        assert engine.model_info["runner"] == "hf"
        outputs = await engine.generate(requests)
    reference = models.load_causal_lm(tiny_model_dir)
    assert max_logprob_error(reference, requests, outputs, temperature) <= TOLERANCE


async def test_compact_greedy_output_equals_transformers_generate(compact_model_path):
    token_lists = prompts(5)
    requests = requests_for(token_lists, max_new_tokens=16, temperature=0.0)
    with running_engine(compact_model_path) as engine:
        outputs = await engine.generate(requests)
    reference = models.load_causal_lm(compact_model_path)
    for ids, output in zip(token_lists, outputs, strict=True):
        expected = reference.generate(
            torch.tensor([ids]), max_new_tokens=16, do_sample=False, pad_token_id=0
        )[0, len(ids) :].tolist()
        assert output.output_ids == expected
    assert max_logprob_error(reference, requests, outputs, temperature=0.0) <= TOLERANCE


async def test_top_k_one_and_tiny_top_p_sample_the_greedy_token(tiny_model_dir):
    token_lists = prompts(3)
    with running_engine(tiny_model_dir) as engine:
        greedy = await engine.generate(requests_for(token_lists, max_new_tokens=6, temperature=0.0))
        top_k = await engine.generate(requests_for(token_lists, max_new_tokens=6, top_k=1))
        top_p = await engine.generate(requests_for(token_lists, max_new_tokens=6, top_p=1e-6))
        min_p = await engine.generate(requests_for(token_lists, max_new_tokens=6, min_p=1.0))
    for a, b, c, d in zip(greedy, top_k, top_p, min_p, strict=True):
        assert a.output_ids == b.output_ids == c.output_ids == d.output_ids


async def test_an_explicit_seed_reproduces_a_sample_and_unseeded_samples_differ(tiny_model_dir):
    prompt = prompts(1)[0]
    seeded = [
        Request(f"s{i}", prompt, SamplingParams(max_new_tokens=10, seed=42)) for i in range(2)
    ]
    unseeded = [Request(f"u{i}", prompt, SamplingParams(max_new_tokens=10)) for i in range(2)]
    with running_engine(tiny_model_dir) as engine:
        first, second, third, fourth = await engine.generate(seeded + unseeded)
    assert first.output_ids == second.output_ids
    assert third.output_ids != fourth.output_ids


# -- batching --------------------------------------------------------------------


async def test_more_requests_than_slots_all_finish_and_identical_prompts_share_prefill(
    tiny_model_dir,
):
    shared = prompts(1, base=500)[0]
    token_lists = [shared] * 5 + prompts(6)
    requests = requests_for(token_lists, max_new_tokens=9, ignore_eos=True)
    with running_engine(tiny_model_dir, max_batch_size=3) as engine:
        outputs = await engine.generate(requests)
        stats = engine.stats
    assert [o.rid for o in outputs] == [r.rid for r in requests]
    assert all(len(o.output_ids) == 9 for o in outputs)
    assert stats["shared_prefill_tokens"] > 0
    assert sum(o.cached_tokens for o in outputs[:5]) >= 2 * len(shared)
    assert len({tuple(o.output_ids) for o in outputs[:5]}) > 1  # n samples, not n copies
    reference = models.load_causal_lm(tiny_model_dir)
    assert max_logprob_error(reference, requests, outputs) <= TOLERANCE


async def test_concurrent_generate_calls_interleave_in_continuous_batching(tiny_llama_dir):
    with running_engine(tiny_llama_dir, max_batch_size=4) as engine:
        batches = [requests_for(prompts(3, base=100 * b), max_new_tokens=5 + b) for b in range(4)]
        results = await asyncio.gather(*(engine.generate(batch) for batch in batches))
    for batch_index, outputs in enumerate(results):
        assert all(o.finish_reason["type"] in ("length", "stop") for o in outputs)
        assert all(len(o.output_ids) <= 5 + batch_index for o in outputs)


async def test_a_streamed_request_gets_its_tokens_in_batches_at_the_marked_tokens_only(
    tiny_model_dir,
):
    """SGLang's interval rule at 4 over 10 tokens marks tokens 1, 5 and 9: three hand-overs to
    the caller's loop (not ten), holding tokens 1, 2-5 and 6-9; the 10th is only in the Output."""
    batches = []
    params = SamplingParams(max_new_tokens=10, temperature=1.0, ignore_eos=True, seed=5)
    request = Request(
        "s",
        prompts(1)[0],
        params,
        on_tokens=lambda ids, lps, vers: batches.append((ids, lps, vers)),
        stream_interval=4,
    )
    with running_engine(tiny_model_dir) as engine:
        (output,) = await engine.generate([request])  # hand-overs run before it resolves
    assert [len(ids) for ids, _, _ in batches] == [1, 4, 4]
    assert [t for ids, _, _ in batches for t in ids] == output.output_ids[:9]
    assert [lp for _, lps, _ in batches for lp in lps] == output.logprobs[:9]
    assert all(vers == ["default"] * len(vers) for _, _, vers in batches)


async def test_the_token_that_ends_a_streamed_request_comes_only_in_its_output(tiny_model_dir):
    """Over 9 tokens the interval rule at 4 marks 1, 5 and 9, but the 9th ends the request:
    its final Output carries it, so a stream never sends the last token twice (once as
    running, once as final) however the two race to the HTTP thread."""
    batches = []
    params = SamplingParams(max_new_tokens=9, temperature=1.0, ignore_eos=True, seed=5)
    request = Request(
        "s",
        prompts(1)[0],
        params,
        on_tokens=lambda ids, lps, vers: batches.append(ids),
        stream_interval=4,
    )
    with running_engine(tiny_model_dir) as engine:
        (output,) = await engine.generate([request])
    assert [len(ids) for ids in batches] == [1, 4]
    assert [t for ids in batches for t in ids] == output.output_ids[:5]
    assert len(output.output_ids) == 9


# -- stopping --------------------------------------------------------------------


async def test_stop_token_ids_and_min_new_tokens(tiny_model_dir):
    prompt = prompts(1)[0]
    greedy = SamplingParams(max_new_tokens=20, temperature=0.0, ignore_eos=True)
    with running_engine(tiny_model_dir) as engine:
        (free,) = await engine.generate([Request("free", prompt, greedy)])
        stop_id = free.output_ids[4]
        first = free.output_ids.index(stop_id)
        params = SamplingParams(
            max_new_tokens=20, temperature=0.0, ignore_eos=True, stop_token_ids=(stop_id,)
        )
        (stopped,) = await engine.generate([Request("stop", prompt, params)])
        late = SamplingParams(**{**params.__dict__, "min_new_tokens": first + 2})
        (delayed,) = await engine.generate([Request("late", prompt, late)])
    assert stopped.finish_reason == {"type": "stop", "matched": stop_id}
    assert stopped.output_ids == free.output_ids[: first + 1]
    assert len(delayed.output_ids) >= first + 2
    assert delayed.output_ids == free.output_ids[: len(delayed.output_ids)]


async def test_eos_stops_unless_ignored(tiny_model_dir):
    prompt = prompts(1)[0]
    with running_engine(tiny_model_dir) as engine:
        (free,) = await engine.generate(
            [Request("a", prompt, SamplingParams(max_new_tokens=12, temperature=0.0))]
        )
        eos_like = free.output_ids[3]
        engine.scheduler.eos_token_ids = frozenset({eos_like})  # pretend it is EOS
        (stopped,) = await engine.generate(
            [Request("b", prompt, SamplingParams(max_new_tokens=12, temperature=0.0))]
        )
        ignored = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
        (kept,) = await engine.generate([Request("c", prompt, ignored)])
    assert stopped.finish_reason == {"type": "stop", "matched": eos_like}
    assert stopped.output_ids[-1] == eos_like
    assert kept.output_ids == free.output_ids


async def test_stop_strings_finish_on_the_decoded_text(tiny_model_dir):
    prompt = prompts(1)[0]
    greedy = SamplingParams(max_new_tokens=20, temperature=0.0, ignore_eos=True)
    with running_engine(tiny_model_dir) as engine:
        (free,) = await engine.generate([Request("free", prompt, greedy)])
        tokenizer = engine.tokenizer
        piece = tokenizer.decode(free.output_ids[5:7])
        stop = piece.strip()[:3] or piece
        params = SamplingParams(
            max_new_tokens=20, temperature=0.0, ignore_eos=True, stop=("never-there", stop)
        )
        (stopped,) = await engine.generate([Request("stop", prompt, params)])
    assert stopped.finish_reason == {"type": "stop", "matched": stop}
    text = tokenizer.decode(stopped.output_ids)
    assert stop in text and stop not in tokenizer.decode(stopped.output_ids[:-1])
    assert stopped.output_ids == free.output_ids[: len(stopped.output_ids)]


async def test_length_limits_and_prompt_checks(tiny_model_dir):
    with running_engine(tiny_model_dir, max_seq_len=24) as engine:
        long_prompt = list(range(100, 120))
        outputs = await engine.generate(
            [
                Request("short", [5, 6, 7], SamplingParams(max_new_tokens=5, ignore_eos=True)),
                Request("capped", long_prompt, SamplingParams(max_new_tokens=50, ignore_eos=True)),
                Request("zero", [5, 6, 7], SamplingParams(max_new_tokens=0)),
            ]
        )
        with pytest.raises(ValueError, match="max_seq_len"):
            await engine.generate([Request("huge", list(range(100, 130)), SamplingParams())])
        with pytest.raises(ValueError, match="empty"):
            await engine.generate([Request("empty", [], SamplingParams())])
        with pytest.raises(ValueError, match="outside"):
            await engine.generate([Request("oov", [1, 49152], SamplingParams())])
    assert outputs[0].finish_reason == {"type": "length", "length": 5}
    assert len(outputs[1].output_ids) == 24 - 20
    assert outputs[1].finish_reason == {"type": "length", "length": 4}
    assert outputs[2].output_ids == [] and outputs[2].finish_reason["type"] == "length"


# -- abort, pause, weight updates -------------------------------------------------


async def wait_for_tokens(engine: EngineCore, count: int) -> None:
    """Until the engine has generated ``count`` tokens in total (test helper)."""
    for _ in range(20000):
        if engine.stats["generated_tokens"] >= count:
            return
        await asyncio.sleep(0.001)
    raise TimeoutError("the engine generated too few tokens")


async def test_abort_returns_partial_outputs_and_cancellation_aborts(tiny_model_dir):
    long = SamplingParams(max_new_tokens=10_000, ignore_eos=True)
    with running_engine(tiny_model_dir, max_seq_len=2048) as engine:
        task = asyncio.ensure_future(
            engine.generate([Request("a", [1, 2, 3], long), Request("b", [4, 5], long)])
        )
        await wait_for_tokens(engine, 10)
        engine.abort("a")
        await wait_for_tokens(engine, engine.stats["generated_tokens"] + 5)
        engine.abort()
        first, second = await task
        cancelled = asyncio.ensure_future(engine.generate([Request("c", [1, 2], long)]))
        await wait_for_tokens(engine, engine.stats["generated_tokens"] + 5)
        cancelled.cancel()
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        await engine.pause("in_place")  # a boundary: the abort has been applied
        assert engine.num_running == 0 and engine.num_waiting == 0 and engine.flush_cache()
        engine.resume()
    for output in (first, second):
        assert output.finish_reason["type"] == "abort"
        assert 0 < len(output.output_ids) < 2000
        assert len(output.logprobs) == len(output.versions) == len(output.output_ids)
    assert len(first.output_ids) < len(second.output_ids)


async def test_pause_abort_aborts_everything_and_new_requests_wait_for_resume(tiny_model_dir):
    with running_engine(tiny_model_dir, max_seq_len=2048) as engine:
        task = asyncio.ensure_future(
            engine.generate(requests_for(prompts(6), max_new_tokens=10_000, ignore_eos=True))
        )
        await wait_for_tokens(engine, 8)
        await engine.pause("abort")
        aborted = await task
        assert engine.is_paused
        queued = asyncio.ensure_future(
            engine.generate(
                [Request("q", [1, 2], SamplingParams(max_new_tokens=4, ignore_eos=True))]
            )
        )
        for _ in range(30000):  # readiness: the request reaches the paused engine's queue
            if engine.num_waiting:
                break
            await asyncio.sleep(0.001)
        assert not queued.done() and engine.num_waiting == 1
        engine.resume()
        (later,) = await queued
    assert all(o.finish_reason["type"] == "abort" for o in aborted)
    assert sum(len(o.output_ids) for o in aborted) >= 8
    assert len(later.output_ids) == 4


async def test_pause_retract_resumes_the_same_seeded_sample(tiny_model_dir):
    requests = [
        Request(f"r{i}", ids, SamplingParams(max_new_tokens=40, ignore_eos=True, seed=i))
        for i, ids in enumerate(prompts(5))
    ]
    with running_engine(tiny_model_dir) as engine:
        uninterrupted = await engine.generate(requests)
        task = asyncio.ensure_future(engine.generate(requests))
        await wait_for_tokens(engine, engine.stats["generated_tokens"] + 30)
        await engine.pause("retract")
        assert engine.num_running == 0 and engine.num_waiting == len(requests)
        engine.resume()
        retracted = await task
    for a, b in zip(uninterrupted, retracted, strict=True):
        assert a.output_ids == b.output_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) <= TOLERANCE
    assert engine.stats["prefill_tokens"] > 2 * sum(len(r.input_ids) for r in requests)


def new_weights(shape: str, seed: int) -> dict[str, torch.Tensor]:
    model = models.load_causal_lm(f"random:{shape}", seed=seed)
    return dict(model.state_dict())


async def test_in_place_update_splits_versions_and_retracted_tokens_follow_the_new_weights(
    tiny_model_dir,
):
    updated = new_weights("qwen3-tiny", seed=1)
    old_model = models.load_causal_lm(tiny_model_dir)
    new_model = models.load_causal_lm("random:qwen3-tiny", seed=1)
    requests = requests_for(prompts(3), max_new_tokens=60, ignore_eos=True)
    with running_engine(tiny_model_dir, weight_version="v0") as engine:
        task = asyncio.ensure_future(engine.generate(requests))
        await wait_for_tokens(engine, 20)
        await engine.pause("retract")
        await engine.update_weights(updated.items(), "v1")
        assert engine.weight_version == "v1"
        engine.resume()
        outputs = await task
        # in_place keeps the KV computed by the old weights: versions still split exactly.
        in_place_task = asyncio.ensure_future(engine.generate(requests))
        await wait_for_tokens(engine, engine.stats["generated_tokens"] + 20)
        await engine.pause("in_place")
        await engine.update_weights(new_weights("qwen3-tiny", seed=0).items(), "v2")
        engine.resume()
        in_place = await in_place_task
    for request, output in zip(requests, outputs, strict=True):
        split = output.versions.index("v1")
        assert (
            split > 0
            and set(output.versions[:split]) == {"v0"}
            and set(output.versions[split:]) == {"v1"}
        )
        old = reference_logprobs(old_model, request.input_ids, output.output_ids)[:split]
        new = reference_logprobs(new_model, request.input_ids, output.output_ids)[split:]
        assert (old - torch.tensor(output.logprobs[:split])).abs().max() <= TOLERANCE
        assert (new - torch.tensor(output.logprobs[split:])).abs().max() <= TOLERANCE
    for output in in_place:
        split = output.versions.index("v2")
        assert split > 0 and set(output.versions[split:]) == {"v2"}


async def test_after_an_update_new_requests_match_the_new_weights_with_tied_embeddings(
    tiny_llama_dir,
):
    updated = {k: v for k, v in new_weights("llama-tiny", seed=7).items() if k != "lm_head.weight"}
    reference = models.load_causal_lm("random:llama-tiny", seed=7)
    requests = requests_for(prompts(4), max_new_tokens=10, temperature=0.0)
    with running_engine(tiny_llama_dir) as engine:
        await engine.update_weights(updated.items(), "7")
        outputs = await engine.generate(requests)
    assert all(o.versions == ["7"] * len(o.output_ids) for o in outputs)
    assert max_logprob_error(reference, requests, outputs) <= TOLERANCE


@pytest.mark.parametrize("runner", ["compact", "hf"])
async def test_a_bad_update_raises_and_changes_nothing(tiny_model_dir, runner):
    good = new_weights("qwen3-tiny", seed=3)
    requests = requests_for(prompts(2), max_new_tokens=8, temperature=0.0)
    with running_engine(tiny_model_dir, runner=runner) as engine:
        before = await engine.generate(requests)
        with pytest.raises(ValueError, match="unknown weight name"):
            await engine.update_weights(
                [*good.items(), ("model.layers.9.nope.weight", torch.zeros(1))], "x"
            )
        wrong = [*good.items(), ("model.norm.weight", torch.zeros(3))]
        with pytest.raises(ValueError, match="shape"):
            await engine.update_weights(wrong, "y")
        after = await engine.generate(requests)
        assert engine.weight_version == "default"
    assert [o.output_ids for o in before] == [o.output_ids for o in after]
    assert [o.logprobs for o in before] == [o.logprobs for o in after]


async def test_hf_runner_serves_waves_with_updates(tiny_model_dir):
    reference = models.load_causal_lm("random:qwen3-tiny", seed=2)
    requests = requests_for(prompts(7), max_new_tokens=6, ignore_eos=True)
    with running_engine(tiny_model_dir, runner="hf", max_batch_size=3) as engine:
        await engine.update_weights(new_weights("qwen3-tiny", seed=2).items(), "2")
        outputs = await engine.generate(requests)
    assert all(len(o.output_ids) == 6 and set(o.versions) == {"2"} for o in outputs)
    assert max_logprob_error(reference, requests, outputs) <= TOLERANCE


async def test_model_info_describes_the_model(tiny_model_dir):
    with running_engine(tiny_model_dir) as engine:
        info = engine.model_info
    assert info["is_generation"] and info["model_type"] == "qwen3"
    assert info["architectures"] == ["Qwen3ForCausalLM"] and info["vocab_size"] == 49152
    assert info["max_seq_len"] == 256 and 2 in info["eos_token_ids"]


# -- graph-shaped decode, sampling, rope, attention kernels -----------------------


async def test_decode_padded_to_graph_buckets_matches_unpadded(tiny_model_dir):
    """Eager steps shaped like the CUDA graphs (padded idle lanes, full-cache reads)."""
    requests = [
        Request(f"r{i}", ids, SamplingParams(max_new_tokens=10, ignore_eos=True, seed=i))
        for i, ids in enumerate(prompts(5))
    ]
    with running_engine(tiny_model_dir, max_batch_size=8) as engine:
        plain = await engine.generate(requests)
        engine.runner.pad_lanes = True
        padded = await engine.generate(requests)
    for a, b in zip(plain, padded, strict=True):
        assert a.output_ids == b.output_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) <= TOLERANCE


def test_the_sampler_follows_the_distribution_and_its_filters():
    from streamrl.engine.runner.sampling import make_sampling_tensors, sample

    probs = torch.tensor([0.5, 0.3, 0.15, 0.05, 0.0])
    rows = 20000
    logits = probs.clamp_min(1e-30).log().expand(rows, -1).contiguous()

    def draw(**overrides):
        params = [SamplingParams(**overrides)] * rows
        tensors = make_sampling_tensors(params, list(range(rows)), [7] * rows, "cpu")
        tokens, logprobs = sample(logits, tensors, use_filters=True)
        return torch.bincount(tokens, minlength=5).float() / rows, logprobs, tokens

    frequencies, logprobs, tokens = draw()
    assert (frequencies - probs).abs().max() < 0.015
    assert torch.allclose(logprobs, probs.clamp_min(1e-30).log()[tokens], atol=1e-5)
    top_k, _, _ = draw(top_k=2)
    assert top_k[2:].sum() == 0 and abs(top_k[0] - 0.5 / 0.8) < 0.015
    top_p, _, _ = draw(top_p=0.7)  # keeps 0.5 and 0.3 (mass before 0.3 is 0.5 < 0.7)
    assert top_p[2:].sum() == 0 and top_p[1] > 0.3
    min_p, _, _ = draw(min_p=0.5)  # keeps p >= 0.25
    assert min_p[2:].sum() == 0
    greedy, logprobs, _ = draw(temperature=0.0)
    assert greedy[0] == 1.0 and torch.allclose(
        logprobs, torch.log(probs[0]).expand(rows), atol=1e-5
    )


def test_seeded_uniforms_are_uniform_and_depend_only_on_seed_and_counter():
    from streamrl.engine.runner.sampling import uniform_from_seed

    seeds = torch.arange(100_000, dtype=torch.int64) * 7919
    values = uniform_from_seed(seeds, torch.full_like(seeds, 3))
    assert values.min() >= 0.0 and values.max() < 1.0
    histogram = torch.histc(values, bins=10, min=0.0, max=1.0) / len(values)
    assert (histogram - 0.1).abs().max() < 0.01
    again = uniform_from_seed(seeds[:10], torch.full((10,), 3))
    assert torch.equal(again, values[:10])
    assert not torch.equal(uniform_from_seed(seeds[:10], torch.full((10,), 4)), values[:10])


def test_llama3_rope_scaling_matches_transformers():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from streamrl.engine.runner.rope import inverse_frequencies

    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    config = LlamaConfig(
        hidden_size=256,
        num_attention_heads=4,
        rope_theta=500000.0,
        rope_scaling=scaling,
        max_position_embeddings=131072,
    )
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    assert torch.allclose(inverse_frequencies(config, 64), expected.float(), rtol=1e-6)


def _rope_store_case(device, dtype, qk_norm: bool):
    """Inputs of `kernels.rope_store` for 5 tokens of a 6-head, 2-KV-head layer."""
    generator = torch.Generator().manual_seed(3)

    def draw(*shape):
        return torch.randn(*shape, generator=generator).to(device=device, dtype=dtype)

    tokens, heads, kv_heads, head_dim = 5, 6, 2, 8
    norms = (draw(head_dim), draw(head_dim)) if qk_norm else (None, None)
    return {
        "qkv": draw(tokens, (heads + 2 * kv_heads) * head_dim),
        "cos_sin": draw(tokens, 2, head_dim),
        "rows": torch.tensor([7, 0, 12, 3, 9], device=device),
        "cache_shape": (16, kv_heads, head_dim),
        "heads": heads,
        "norms": norms,
    }


def _rope_store(rope_store, case):
    """Run ``rope_store`` on fresh zeroed caches: (queries, keys, values)."""
    qkv, (rows_total, kv_heads, head_dim) = case["qkv"], case["cache_shape"]
    keys = torch.zeros(rows_total, kv_heads, head_dim, device=qkv.device, dtype=qkv.dtype)
    values = torch.zeros_like(keys)
    queries = qkv.new_empty(qkv.shape[0], case["heads"], head_dim)
    rope_store(qkv, case["cos_sin"], keys, values, case["rows"], queries, *case["norms"], 1e-6)
    return queries, keys, values


@pytest.mark.parametrize("qk_norm", [False, True], ids=["qwen2", "qwen3"])
def test_rope_store_rotates_queries_and_stores_keys_and_values(qk_norm):
    from streamrl.engine.runner.kernels import rms_norm, rope_store
    from streamrl.engine.runner.rope import apply_rope

    case = _rope_store_case("cpu", torch.float32, qk_norm)
    queries, keys, values = _rope_store(rope_store, case)
    heads, (_, kv_heads, head_dim) = case["heads"], case["cache_shape"]
    q, k, v = case["qkv"].view(5, -1, head_dim).split([heads, kv_heads, kv_heads], dim=1)
    if qk_norm:
        q, k = rms_norm(q, case["norms"][0], 1e-6), rms_norm(k, case["norms"][1], 1e-6)
    assert torch.equal(queries, apply_rope(q, case["cos_sin"]))
    rows = case["rows"]
    assert torch.equal(keys[rows], apply_rope(k, case["cos_sin"]))
    assert torch.equal(values[rows], v)
    untouched = torch.ones(16, dtype=torch.bool)
    untouched[rows] = False
    assert not keys[untouched].any() and not values[untouched].any()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("qk_norm", [False, True], ids=["qwen2", "qwen3"])
@pytest.mark.parametrize("kernel", ["inductor", "triton"])
def test_compiled_rope_store_equals_eager_on_cuda(qk_norm, kernel):
    from streamrl.engine.runner import kernels, triton_ops

    case = _rope_store_case("cuda", torch.bfloat16, qk_norm)
    if kernel == "triton":
        if not triton_ops.available(torch.device("cuda")):
            pytest.skip("no Triton")
        fused = triton_ops.rope_store
    else:
        fused = kernels.compiled_ops().rope_store
    got = _rope_store(fused, case)
    want = _rope_store(kernels.rope_store, case)
    for got_one, want_one in zip(got, want, strict=True):
        # Inductor stays in float32 until the stores; the Triton kernel rounds op by op but
        # was not bit-exact with the eager ops on the H200 (2026-12-04): one bf16 step
        # (2**-7 relative) at most.
        torch.testing.assert_close(got_one, want_one, rtol=2**-7, atol=2**-7)


def test_decode_and_prefill_attention_equal_plain_softmax_attention():
    from streamrl.engine.runner.attention import decode_attention, prefill_attention

    torch.manual_seed(0)
    heads, kv_heads, head_dim, slots, seq_len = 4, 2, 16, 3, 12
    k_cache = torch.randn(slots, seq_len, kv_heads, head_dim)
    v_cache = torch.randn(slots, seq_len, kv_heads, head_dim)
    q = torch.randn(slots, heads, head_dim)
    lengths = torch.tensor([1, 7, 12], dtype=torch.int32)
    out = decode_attention(q, k_cache, v_cache, lengths, seq_len, use_flash=False)
    for lane in range(slots):
        n = int(lengths[lane])
        keys = k_cache[lane, :n].repeat_interleave(2, dim=1)  # [n, heads, d]
        values = v_cache[lane, :n].repeat_interleave(2, dim=1)
        weights = torch.softmax(torch.einsum("hd,nhd->hn", q[lane], keys) / head_dim**0.5, -1)
        assert torch.allclose(out[lane], torch.einsum("hn,nhd->hd", weights, values), atol=1e-5)
    seq_lens = [3, 5]
    packed_q = torch.randn(8, heads, head_dim)
    packed_k = torch.randn(8, kv_heads, head_dim)
    packed_v = torch.randn(8, kv_heads, head_dim)
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    out = prefill_attention(packed_q, packed_k, packed_v, cu, seq_lens, use_flash=False)
    second = torch.nn.functional.scaled_dot_product_attention(
        packed_q[3:].transpose(0, 1),
        packed_k[3:].repeat_interleave(2, dim=1).transpose(0, 1),
        packed_v[3:].repeat_interleave(2, dim=1).transpose(0, 1),
        is_causal=True,
    ).transpose(0, 1)
    assert torch.allclose(out[3:], second, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_flash_attention_agrees_with_sdpa_on_cuda():
    from streamrl.engine.runner.attention import decode_attention, prefill_attention

    torch.manual_seed(0)
    device, dtype = torch.device("cuda"), torch.bfloat16
    slots, seq_len, heads, kv_heads, head_dim = 5, 64, 14, 2, 64
    k_cache = torch.randn(slots, seq_len, kv_heads, head_dim, device=device, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(slots, heads, head_dim, device=device, dtype=dtype)
    lengths = torch.tensor([1, 9, 64, 33, 2], device=device, dtype=torch.int32)
    flash = decode_attention(q, k_cache, v_cache, lengths, seq_len, use_flash=True)
    sdpa = decode_attention(q, k_cache, v_cache, lengths, seq_len, use_flash=False)
    assert (flash.float() - sdpa.float()).abs().max() < 2e-2
    seq_lens = [5, 17, 1]
    total = sum(seq_lens)
    packed = [
        torch.randn(total, h, head_dim, device=device, dtype=dtype)
        for h in (heads, kv_heads, kv_heads)
    ]
    cu = torch.tensor([0, 5, 22, 23], device=device, dtype=torch.int32)
    flash = prefill_attention(*packed, cu, seq_lens, use_flash=True)
    sdpa = prefill_attention(*packed, cu, seq_lens, use_flash=False)
    assert (flash.float() - sdpa.float()).abs().max() < 2e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(
    "slots, seq_len, heads, kv_heads, head_dim",
    [
        (5, 64, 14, 2, 64),
        (7, 448, 14, 2, 64),
        (300, 200, 14, 2, 64),
        (3, 4096, 16, 8, 128),
        (4, 300, 4, 4, 32),
    ],
    ids=["7-to-1", "7-to-1-spans", "7-to-1-lanes-fill-the-gpu", "2-to-1-long", "one-to-one"],
)
def test_split_decode_agrees_with_sdpa_on_cuda(slots, seq_len, heads, kv_heads, head_dim):
    from streamrl.engine.runner import split_decode
    from streamrl.engine.runner.attention import decode_attention

    if not split_decode.available(torch.device("cuda"), torch.bfloat16, head_dim):
        pytest.skip("no Triton")
    torch.manual_seed(0)
    shape = (slots + 1, seq_len, kv_heads, head_dim)
    k_cache = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(slots, heads, head_dim, device="cuda", dtype=torch.bfloat16)
    lengths = torch.randint(1, seq_len + 1, (slots,), device="cuda", dtype=torch.int32)
    lengths[0], lengths[-1] = 1, seq_len  # one key; every span
    got = split_decode.decode_attention(q, k_cache, v_cache, lengths)
    want = decode_attention(
        q.float(), k_cache.float(), v_cache.float(), lengths, seq_len, use_flash=False
    )
    # float32 softmax and sums over bf16 inputs, rounded to bf16 once at the end
    assert got.dtype == torch.bfloat16 and got.shape == q.shape
    torch.testing.assert_close(got.float(), want, rtol=2**-7, atol=2**-7)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_triton_silu_mul_equals_eager_on_cuda():
    from streamrl.engine.runner import kernels, triton_ops

    if not triton_ops.available(torch.device("cuda")):
        pytest.skip("no Triton")
    torch.manual_seed(0)
    for rows, width in ((1, 7), (64, 4864), (300, 1000 + 1024)):
        gate_up = 4 * torch.randn(rows, 2 * width, device="cuda", dtype=torch.bfloat16)
        got, want = triton_ops.silu_mul(gate_up), kernels.silu_mul(gate_up)
        # exp may differ from CUDA's in the last float32 bit: one bf16 step at most
        torch.testing.assert_close(got, want, rtol=2**-7, atol=2**-7)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_triton_sampler_agrees_with_the_torch_sampler_on_cuda():
    from streamrl.engine.runner import triton_ops
    from streamrl.engine.runner.sampling import SamplingTensors, sample, uniform_from_seed

    if not triton_ops.available(torch.device("cuda")):
        pytest.skip("no Triton")
    torch.manual_seed(0)
    rows, vocab = 300, 49152
    logits = (3 * torch.randn(rows, vocab, device="cuda")).to(torch.bfloat16)
    temperature = torch.rand(rows, device="cuda") + 0.3
    temperature[:7] = 0  # greedy rows
    st = SamplingTensors(
        temperature=temperature,
        top_p=torch.ones(rows, device="cuda"),
        top_k=torch.zeros(rows, device="cuda", dtype=torch.int64),
        min_p=torch.zeros(rows, device="cuda"),
        seeds=torch.arange(rows, device="cuda"),
        counters=torch.full((rows,), 11, device="cuda"),
    )
    want_tokens, want_logprobs = sample(logits, st, use_filters=False)
    got_tokens, got_logprobs = sample(
        logits, st, use_filters=False, unfiltered=triton_ops.sample_rows
    )
    # The same inverse-CDF rule and the same uniforms: the same tokens (a row could differ
    # only where u * total falls within float32 rounding of a token's cumulative edge).
    assert torch.equal(got_tokens, want_tokens)
    torch.testing.assert_close(got_logprobs, want_logprobs, rtol=0, atol=1e-4)
    # Drawn often from one row of 50 tokens: the softmax's frequencies (chi-square, 49
    # degrees of freedom: 100 is exceeded with probability under 1e-5).
    draws, row = 20_000, 2 * torch.randn(50, device="cuda")
    tokens, _ = triton_ops.sample_rows(
        row.expand(draws, 50).contiguous(),
        torch.ones(draws, device="cuda"),
        torch.zeros(draws, device="cuda", dtype=torch.bool),
        uniform_from_seed(
            torch.arange(draws, device="cuda"), torch.zeros_like(torch.arange(draws, device="cuda"))
        ),
    )
    expected = draws * torch.softmax(row, dim=0)
    observed = torch.bincount(tokens, minlength=50).float()
    assert ((observed - expected) ** 2 / expected).sum().item() < 100


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
async def test_cuda_graph_decode_equals_eager_decode_on_cuda():
    requests = [
        Request(f"r{i}", ids, SamplingParams(max_new_tokens=16, ignore_eos=True, seed=i))
        for i, ids in enumerate(prompts(8))
    ]
    results = []
    for cuda_graphs in (True, False):
        with running_engine(
            "random:qwen2-tiny", device="cuda", cuda_graphs=cuda_graphs, max_batch_size=8
        ) as engine:
            assert (engine.runner.graphs is not None) == cuda_graphs
            results.append(await engine.generate(requests))
    for graphed, eager in zip(*results, strict=True):
        assert graphed.output_ids == eager.output_ids
        assert max(abs(a - b) for a, b in zip(graphed.logprobs, eager.logprobs, strict=True)) < 1e-3


def test_the_compact_runner_reads_saved_files_and_leaves_unknown_names_to_transformers(
    tmp_path, caplog
):
    from safetensors.torch import load_file, save_file

    from streamrl.engine.runner.select import build_runner

    path = models.save_random_model("qwen3-tiny", tmp_path / "m", seed=1)
    options = dict(runner="compact", device=torch.device("cpu"), dtype=torch.float32,
                   max_batch_size=2, max_seq_len=64, max_prefill_tokens=64,
                   cuda_graphs=False, compile_elementwise=False, seed=0)  # fmt: skip
    direct, _ = build_runner(str(path), **options)
    # An extra tensor the compact model has no place for: transformers drops it on load.
    tensors = load_file(path / "model.safetensors")
    save_file({**tensors, "model.extra.weight": torch.ones(3)}, path / "model.safetensors",
              metadata={"format": "pt"})  # fmt: skip
    with caplog.at_level("INFO", logger="streamrl.engine.runner.select"):
        mapped, _ = build_runner(str(path), **options)
    assert "through transformers" in caplog.text and "model.extra.weight" in caplog.text
    expected = models.load_causal_lm("random:qwen3-tiny", seed=1)
    for name, tensor in expected.state_dict().items():
        for runner in (direct, mapped):
            parameter, first, end = runner.targets[name]
            assert torch.equal(parameter[first:end], tensor), name
