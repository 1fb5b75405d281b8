"""Every pushed bucket is verified by digest: a corrupted one is refused and sent again."""

from __future__ import annotations

import anyio
import pytest
import torch
from engine_helpers import running_engines, teacher_forced_logprobs

from streamrl.fleet.client import EngineClient
from streamrl.models import build_random_model
from streamrl.publish import group_transport as group_transport_module
from streamrl.publish.group_transport import GroupTransport
from streamrl.publish.publisher import WeightPublisher
from streamrl.weights import digest as digest_module
from streamrl.weights.digest import digest
from streamrl.weights.group import FlatLayout


def test_the_digest_sees_a_changed_byte_and_two_swapped_words():
    data = torch.randint(
        0, 256, (4000,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0)
    )
    flipped = data.clone()
    flipped[1234] ^= 1
    words = data.view(torch.int16)
    i, j = 10, next(k for k in range(11, 2000) if words[k] != words[10])
    swapped_words = words.clone()
    swapped_words[i], swapped_words[j] = words[j], words[i]
    swapped = swapped_words.view(torch.uint8)
    assert len({digest([data]), digest([flipped]), digest([swapped])}) == 3
    assert digest([data]) == digest([data.clone()])


def _by_definition(data: bytes) -> str:
    """S1 = sum w_j and S2 = sum (j + 1) w_j modulo 2^61 - 1 over the bytes' signed 16-bit
    little-endian words (an odd last byte padded with a zero), one word at a time."""
    modulus = (1 << 61) - 1
    if len(data) % 2:
        data += b"\0"
    words = [int.from_bytes(data[i : i + 2], "little", signed=True) for i in range(0, len(data), 2)]
    plain = sum(words) % modulus
    weighted = sum((j + 1) * w for j, w in enumerate(words)) % modulus
    return f"{plain:016x}{weighted:016x}"


@pytest.mark.parametrize("chunk_words", [300, 1 << 20])
def test_the_digest_is_its_two_sums_across_rows_chunks_and_tensors(monkeypatch, chunk_words):
    """Small chunks put chunk and row boundaries inside tensors, with tails shorter than a
    row; tensors of an odd byte count put the words after them off the tensors' own
    alignment; the sums are exact however the bytes are split."""
    monkeypatch.setitem(digest_module._CHUNK_WORDS, "cpu", chunk_words)
    generator = torch.Generator().manual_seed(1)
    sizes = (3, 256, 1000, 5001, 255, 4)
    tensors = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=generator) for n in sizes]
    tensors.append(torch.full((1300,), 255, dtype=torch.uint8))  # words of -1
    tensors.append(torch.tensor([0x7F, 0xFF] * 700, dtype=torch.uint8).flip(0))  # 0x7FFF
    tensors.append(torch.randn(33, generator=generator).to(torch.bfloat16))
    tensors.append(torch.ones(5, dtype=torch.bool))  # ends the stream on an odd byte
    everything = b"".join(bytes(t.contiguous().view(torch.uint8).tolist()) for t in tensors)
    assert digest(tensors) == _by_definition(everything)
    assert digest([torch.cat([t.view(torch.uint8) for t in tensors])]) == _by_definition(everything)


def test_the_largest_words_stay_exact_in_a_whole_chunk():
    """A chunk of 2^23 words of the largest magnitude: its int64 sums do not overflow."""
    for value in (-(1 << 15), (1 << 15) - 1):
        words = torch.full((1 << 23,), value, dtype=torch.int16)
        n = words.numel()
        plain = value * n % digest_module.MODULUS
        weighted = value * n * (n + 1) // 2 % digest_module.MODULUS
        assert digest([words]) == f"{plain:016x}{weighted:016x}"


def test_a_bucket_and_its_tensors_back_to_back_have_one_digest():
    tensors = [torch.randn(3, 5), torch.randn(7).to(torch.bfloat16), torch.randn(2, 2)]
    layout = FlatLayout([(tuple(t.shape), t.dtype) for t in tensors])
    flat = torch.empty(layout.num_bytes, dtype=torch.uint8)
    layout.pack(tensors, flat)
    assert digest([flat]) == digest(tensors) == digest(layout.unpack(flat))


def test_the_views_of_one_bucket_are_read_as_one_run_and_digest_as_the_bucket(monkeypatch):
    """An engine digests a flattened bucket's views: those that follow one another in its
    storage are one run of words (one kernel launch on a GPU), and the digest is the
    bucket's; a copy, a gap or an empty tensor between them starts a new run or adds
    nothing."""
    tensors = [torch.randn(3, 5), torch.randn(2, 2), torch.randn(7).to(torch.bfloat16),
               torch.ones(3, dtype=torch.bool), torch.randn(6)]  # fmt: skip
    layout = FlatLayout([(tuple(t.shape), t.dtype) for t in tensors])
    flat = torch.empty(layout.num_bytes, dtype=torch.uint8)
    layout.pack(tensors, flat)
    views = layout.unpack(flat)  # the last one, misaligned after the bools, is a copy
    runs = []
    real_word_runs = digest_module._word_runs

    def recorded(ts):
        for run in real_word_runs(ts):
            runs.append(run)
            yield run

    monkeypatch.setattr(digest_module, "_word_runs", recorded)
    assert digest(views) == digest([flat]) == digest(tensors)
    runs.clear()
    digest(views)
    # The first four views are one stretch of the bucket, 93 bytes; its odd end joins the
    # copy after it (24 bytes) and a padding byte: one run of words in all.
    assert [r.numel() * 2 for r in runs] == [layout.num_bytes + 1]
    runs.clear()
    empty = flat[:0]
    assert digest([views[0], empty, views[1]]) == digest([views[0], views[1]])
    gap = [flat[:8], flat[16:24]]  # not back to back: two runs, the bytes of each
    runs.clear()
    separate = digest(gap)
    assert len(runs) == 2
    assert separate == digest([torch.cat(gap)])


def test_no_kernel_is_built_for_the_cpu():
    assert digest_module.build_kernel("cpu") is False


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_gpu_kernel_built_ahead_digests_as_the_cpu_does():
    assert digest_module.build_kernel("cuda") is True
    for count in (4096, 4097):  # word counts of both specialisations
        words = torch.randint(-(2**15), 2**15, (count,), dtype=torch.int16)
        assert digest([words.cuda()]) == digest([words])


@pytest.mark.anyio
async def test_a_bucket_corrupted_on_its_way_is_refused_and_the_engine_resynced(
    tiny_model_dir, tmp_path, monkeypatch
):
    model = build_random_model("qwen3-tiny", seed=41)
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    real_broadcast = group_transport_module.broadcast_flat
    corrupted: list[int] = []

    def broadcast_once_corrupted(group, flat: torch.Tensor) -> None:
        if not corrupted:  # one byte flipped on the wire, the staging buffer left intact
            copy = flat.clone()
            copy[len(copy) // 2] ^= 0xFF
            corrupted.append(len(copy))
            return real_broadcast(group, copy)
        return real_broadcast(group, flat)

    monkeypatch.setattr(group_transport_module, "broadcast_flat", broadcast_once_corrupted)
    published: list[int] = []

    async def on_published(version: int) -> None:
        published.append(version)

    async def one_gpu(engines) -> list[int]:
        return [1] * len(engines)

    prompt = [1, 504, 3458, 314, 253]
    with running_engines(tiny_model_dir, tmp_path, extra_args=["--weight-version", "0"]) as (
        engine,
    ):
        async with EngineClient(engine.url, timeout_s=120) as client:
            publisher = WeightPublisher(
                weights=lambda: iter(weights.items()),
                members=lambda: [client],
                on_published=on_published,
                transport=GroupTransport(members=lambda: [client], gpu_counts=one_gpu),
                pause_mode="in_place",
            )
            async with anyio.create_task_group() as tasks:
                await tasks.start(publisher.run)
                with anyio.fail_after(120):
                    await publisher.publish(1)
                    await publisher.wait_idle()
                tasks.cancel_scope.cancel()
            result = await client.generate(prompt, {"max_new_tokens": 8, "temperature": 0.0})
            version = await client.weight_version()
    assert corrupted and publisher.num_digest_mismatches == 1
    assert [record.ok for record in publisher.records] == [True] and published == [1]
    assert version == 1
    expected = teacher_forced_logprobs(tiny_model_dir, prompt, result.output_ids, weights)
    assert max(abs(a - b) for a, b in zip(result.logprobs, expected, strict=True)) < 1e-4
    log = (tmp_path / next(p.name for p in tmp_path.glob("engine-*.log"))).read_text()
    assert "weights digest mismatch" in log  # the engine refused the corrupted bucket
