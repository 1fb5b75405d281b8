"""Packed rows (`learner.pack_sequences`): the layout `batching` builds, and the torch
backend's values, loss and gradients on it against right-padded rows.

Tolerance: both layouts compute the same float32 sums over other row widths, so they
differ by rounding only. A log-probability near -11 (ln of the 49,152-token vocabulary)
has a float32 spacing of 1e-6; a few roundings through two layers stay within 1e-5, and a
token that saw another sample moves by more than 1e-2 (checked below). Gradients are
compared relative to the largest: 1e-5 of it.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from streamrl.backends.batching import (
    gather_responses,
    make_micro_batches,
    scatter_responses,
    token_counts,
)
from streamrl.backends.torch import TorchBackend
from streamrl.config import LearnerConfig, LoraConfig
from streamrl.types import Sample

LOGPROB_TOL = 1e-5
GRAD_REL_TOL = 1e-5


def _samples(lengths=((3, 5), (1, 9), (6, 1), (2, 14), (4, 4), (9, 20)), *, routed_width=0):
    """Samples of (prompt, response) tokens, a fifth of the response untrained; with
    `routed_width`, routed experts for every token but the last."""
    rng = np.random.default_rng(4)
    samples = []
    for prompt, response in lengths:
        routed = None
        if routed_width:
            routed = rng.integers(0, 8, (prompt + response - 1, routed_width))
        samples.append(
            Sample(
                prompt_ids=rng.integers(1, 1000, prompt),
                response_ids=rng.integers(1, 1000, response),
                logprobs=-rng.random(response),
                versions=[0] * response,
                loss_mask=(rng.random(response) < 0.8).astype(np.float32),
                routed_experts=routed,
            )
        )
    return samples


def _batches(samples, *, packed: bool, token_budget: int = 40):
    return make_micro_batches(
        samples, list(range(len(samples))), token_budget=token_budget, pad_id=0, packed=packed
    )


# ---------------------------------------------------------------- the layout


def test_a_packed_row_holds_samples_back_to_back_with_positions_from_0_in_each():
    samples = _samples()
    batches = _batches(samples, packed=True)
    assert sorted(i for b in batches for i in b.sample_indices) == list(range(len(samples)))
    for batch in batches:
        assert batch.input_ids.shape == (1, batch.num_tokens)  # no padding
        assert batch.num_tokens <= 40 or len(batch.sample_indices) == 1
        for index, (row, column) in zip(batch.sample_indices, batch.placements(), strict=True):
            sample = samples[index]
            length = len(sample.prompt_ids) + len(sample.response_ids)
            tokens = np.concatenate([sample.prompt_ids, sample.response_ids])
            assert batch.input_ids[row, column : column + length].tolist() == tokens.tolist()
            assert batch.position_ids[row, column : column + length].tolist() == list(range(length))
            start = column + len(sample.prompt_ids)
            assert batch.loss_mask[row, start : column + length].tolist() == list(sample.loss_mask)


def test_values_go_out_to_packed_rows_and_come_back_to_their_samples():
    samples = _samples()
    per_sample = torch.arange(6 * 20, dtype=torch.float32).reshape(6, 20) + 1
    for packed in (False, True):
        batches = _batches(samples, packed=packed)
        spread = [scatter_responses(samples, batch, per_sample) for batch in batches]
        back = gather_responses(samples, batches, spread)
        for index, sample in enumerate(samples):
            width = len(sample.response_ids)
            assert torch.equal(back[index, :width], per_sample[index, :width])
            assert not back[index, width:].any()


def test_routed_experts_sit_beside_their_tokens_in_a_packed_row_with_minus_one_elsewhere():
    samples = _samples(routed_width=4)
    (batch,) = _batches(samples, packed=True, token_budget=1000)
    table = batch.extras["routed_experts"]
    assert table.shape == (1, batch.input_ids.shape[1], 4)
    covered = torch.zeros(batch.input_ids.shape[1], dtype=torch.bool)
    for index, (_, column) in zip(batch.sample_indices, batch.placements(), strict=True):
        routed = samples[index].routed_experts
        assert table[0, column : column + len(routed)].tolist() == routed.tolist()
        covered[column : column + len(routed)] = True
    assert (table[0, ~covered] == -1).all()  # each sample's last token, and padding


def test_packing_32_samples_of_256_to_8192_tokens_computes_no_padding():
    """The issue's spread at a mini-batch of 32 samples, by batching alone (the figure the
    learner reports as train/token_efficiency): packed rows compute no padding and
    fill the budget better (fewer micro-batches); right-padded rows, sorted by length,
    compute about 7% padding here (more with fewer samples, less with more)."""
    rng = np.random.default_rng(0)
    samples = [
        Sample(
            prompt_ids=np.ones(int(rng.integers(64, 512)), dtype=np.int64),
            response_ids=np.ones(int(n), dtype=np.int64),
            logprobs=np.zeros(int(n)),
            versions=[0] * int(n),
            loss_mask=np.ones(int(n)),
        )
        for n in rng.integers(256, 8193, 32)
    ]
    efficiency, count = {}, {}
    for packed in (False, True):
        batches = _batches(samples, packed=packed, token_budget=16384)
        real, computed = token_counts(batches)
        efficiency[packed], count[packed] = real / computed, len(batches)
    assert efficiency[True] == 1.0  # rows exactly as wide as their samples
    assert efficiency[False] < 0.95
    assert count[True] < count[False]


# ---------------------------------------------------------------- the torch backend


def _loss(micro_batch, logprobs, entropy):
    def mean(values):
        return (values * micro_batch.loss_mask).sum() / micro_batch.num_tokens_in_mini_batch

    value = mean(-logprobs * micro_batch.advantages) - 0.1 * mean(entropy)
    return value, {"loss": value.detach(), "entropy": mean(entropy).detach()}


def _layout_run(backend: TorchBackend, samples, *, packed: bool) -> dict:
    """Log-probabilities, critic values, one step's loss metrics and gradients (no update)."""
    batches = _batches(samples, packed=packed)
    advantages = torch.from_numpy(np.random.default_rng(9).standard_normal((len(samples), 32)))
    for batch in batches:
        batch.advantages = scatter_responses(samples, batch, advantages.float())
    result = {
        "logprobs": gather_responses(
            samples, batches, backend.compute_logprobs(batches, temperature=0.8)
        )
    }
    if backend.critic is not None:
        result["values"] = gather_responses(
            samples, batches, backend.critic.compute_values(batches)
        )
    if backend.need_reference:
        reference = backend.compute_logprobs(batches, temperature=0.8, reference=True)
        result["reference"] = gather_responses(samples, batches, reference)
    backend.optimizer.zero_grad(set_to_none=True)
    sums = {}
    for batch in batches:
        b, logprobs, entropy = backend._forward(backend.model, batch, 0.8, True)
        loss, metrics = _loss(b, logprobs, entropy)
        loss.backward()
        for key, value in metrics.items():
            sums[key] = sums.get(key, 0.0) + float(value)
    result["metrics"] = sums
    result["grads"] = {
        name: p.grad.clone() for name, p in backend.model.named_parameters() if p.grad is not None
    }
    return result


@pytest.mark.parametrize("variant", ["full", "lora", "critic"])
def test_packed_rows_give_the_torch_backend_the_logprobs_loss_and_grads_of_padded_rows(
    tiny_model_dir, variant
):
    learner = LearnerConfig(lora=LoraConfig(rank=4) if variant == "lora" else LoraConfig())
    backend = TorchBackend(
        tiny_model_dir, learner, device=torch.device("cpu"), dtype=torch.float32,
        critic_path=tiny_model_dir if variant == "critic" else None,
        need_reference=variant != "critic",
    )  # fmt: skip
    if backend.critic is not None:  # a head that gives values other than 0
        torch.nn.init.normal_(backend.critic.model.head.weight)
    samples = _samples()
    padded = _layout_run(backend, samples, packed=False)
    packed = _layout_run(backend, samples, packed=True)
    for key in ("logprobs", "values", "reference"):
        if key in padded:
            assert padded[key].abs().max() > 0.1
            assert (packed[key] - padded[key]).abs().max() < LOGPROB_TOL, key
    for key, value in padded["metrics"].items():
        assert packed["metrics"][key] == pytest.approx(value, rel=1e-5), key
    largest = max(float(g.abs().max()) for g in padded["grads"].values())
    assert largest > 0 and set(packed["grads"]) == set(padded["grads"])
    for name, grad in padded["grads"].items():
        assert (packed["grads"][name] - grad).abs().max() <= GRAD_REL_TOL * largest, name


def test_the_cuda_paths_one_varlen_call_attends_as_sdpa_on_each_sample(monkeypatch):
    """`attend_within_samples`' CUDA path flattens the micro-batch's rows into one sequence
    list for variable-length flash attention. Flash runs on CUDA only, so here a reference
    varlen kernel (causal SDPA per cumulative span, written for this test) stands in for it:
    this checks the flattening, the span boundaries across rows, GQA and the way back, on
    both signatures torch has had (`window_size` with `enable_gqa`; `is_causal` alone)."""
    from streamrl.backends import documents

    def reference(q, k, v, cu_q, cu_k, max_q, max_k, *, scale, **options):
        assert cu_q is cu_k and cu_q.dtype == torch.int32
        assert max_q == max_k == max(int(e - s) for s, e in itertools.pairwise(cu_q.tolist()))
        out = torch.empty_like(q)
        for start, end in itertools.pairwise(cu_q.tolist()):
            out[start:end] = torch.nn.functional.scaled_dot_product_attention(
                q[start:end].transpose(0, 1), k[start:end].transpose(0, 1),
                v[start:end].transpose(0, 1), is_causal=True, scale=scale,
                enable_gqa=options.get("enable_gqa", False),
            ).transpose(0, 1)  # fmt: skip
        return out

    generator = torch.Generator().manual_seed(0)
    spans = [[(0, 150), (150, 157), (157, 158), (158, 200)], [(0, 90), (90, 200)]]
    query = torch.randn(2, 4, 200, 16, generator=generator)
    key, value = (torch.randn(2, 2, 200, 16, generator=generator) for _ in range(2))
    by_sample = documents.attend_within_samples(query, key, value, spans, scale=0.25)
    for signature in ({"window_size": (-1, 0)}, {"is_causal": True}):
        state = {"function": reference, "causal": signature, "gqa": "window_size" in signature}
        monkeypatch.setattr(documents, "_VARLEN", state)
        varlen = documents._attend_varlen(query, key, value, spans, scale=0.25, kernel="torch")
        assert (varlen - by_sample).abs().max() < 1e-5, signature
    # the other row's tokens are not seen: the second row's first sample alone
    alone = torch.nn.functional.scaled_dot_product_attention(
        query[1:, :, :90], key[1:, :, :90], value[1:, :, :90], is_causal=True, scale=0.25,
        enable_gqa=True,
    )  # fmt: skip
    assert (varlen[1:, :, :90] - alone).abs().max() < 1e-5


def test_packed_attention_takes_the_varlen_kernel_only_where_flash_serves_it():
    """On the CPU (flash attention is CUDA's), float32 or bf16, packed rows go per sample."""
    from streamrl.backends import documents

    query = torch.zeros(1, 4, 8, 16)
    assert documents._varlen_kernels(query, query) == []  # CPU
    assert documents._varlen_kernels(query.bfloat16(), query.bfloat16()) == []  # CPU, bf16


def test_without_the_document_mask_a_packed_sample_would_see_the_one_before_it(tiny_model_dir):
    """The check above can fail: the same packed row with a plain causal mask (one sample
    attending to the previous one) moves log-probabilities far past the tolerance."""
    backend = TorchBackend(
        tiny_model_dir, LearnerConfig(), device=torch.device("cpu"), dtype=torch.float32
    )
    samples = _samples()
    batches = _batches(samples, packed=True)
    masked = gather_responses(samples, batches, backend.compute_logprobs(batches, temperature=1))
    for batch in batches:
        batch.position_ids = torch.arange(batch.input_ids.shape[1])[None]
    leaking = gather_responses(samples, batches, backend.compute_logprobs(batches, temperature=1))
    assert (leaking - masked).abs().max() > 1e-2


def _rewarded_groups():
    """`_samples()` in groups of two, each rewarded by its response length's parity."""
    from streamrl.types import Group

    samples = _samples()
    groups = [
        Group(group_id=f"g{i}", prompt_seq=i, prompt_index=i, samples=samples[i : i + 2])
        for i in range(0, len(samples), 2)
    ]
    for sample in samples:
        sample.reward = float(len(sample.response_ids) % 2)
    return samples, groups


def test_a_training_step_reports_the_share_of_its_computed_tokens_that_are_not_padding(
    tiny_model_dir,
):
    from streamrl.backends.step import train_step
    from streamrl.config import config_from_dict

    samples, groups = _rewarded_groups()
    efficiency = {}
    for packed in (False, True):
        cfg = config_from_dict(
            {
                "data": {"path": "x"},
                "model": {"path": tiny_model_dir},
                "rollout": {"batch_size": len(groups), "n_samples_per_prompt": 2},
                "learner": {"micro_batch_tokens": 40, "pack_sequences": packed},
            }
        )
        backend = TorchBackend(
            tiny_model_dir, cfg.learner, device=torch.device("cpu"), dtype=torch.float32
        )
        metrics = train_step(backend, groups, cfg, pad_id=0)
        efficiency[packed] = metrics["train/token_efficiency"]
    real, computed = token_counts(_batches(samples, packed=False))
    assert efficiency[False] == pytest.approx(real / computed) and efficiency[False] < 0.95
    assert efficiency[True] == 1.0


@pytest.mark.parametrize("packed", [False, True])
def test_the_forward_only_passes_take_their_own_token_budget(tiny_model_dir, packed):
    """`learner.logprob_micro_batch_tokens`: the proximal pass (two optimizer steps a step
    need one) runs on micro-batches of that budget, training on micro_batch_tokens', and each
    sample's proximal log-probabilities are those of the training budget's micro-batches."""
    from streamrl.backends.step import train_step
    from streamrl.config import config_from_dict

    class Recording(TorchBackend):
        def compute_logprobs(self, micro_batches, **kwargs):
            out = super().compute_logprobs(micro_batches, **kwargs)
            self.recorded_forward.append((micro_batches, out))
            return out

        def train_mini_batch(self, micro_batches, *args, **kwargs):
            self.recorded_training.extend(micro_batches)
            return super().train_mini_batch(micro_batches, *args, **kwargs)

    samples, groups = _rewarded_groups()
    proximal, widths = {}, {}
    for budget in (0, 200):
        cfg = config_from_dict(
            {
                "data": {"path": "x"},
                "model": {"path": tiny_model_dir},
                "rollout": {"batch_size": len(groups), "n_samples_per_prompt": 2},
                "learner": {
                    "micro_batch_tokens": 40, "logprob_micro_batch_tokens": budget,
                    "pack_sequences": packed, "global_batch_size": len(samples) // 2,
                },
            }
        )  # fmt: skip
        backend = Recording(
            tiny_model_dir, cfg.learner, device=torch.device("cpu"), dtype=torch.float32
        )
        backend.recorded_forward, backend.recorded_training = [], []
        train_step(backend, groups, cfg, pad_id=0)
        (batches, logprobs), *others = backend.recorded_forward
        assert not others  # the proximal pass only (no KL reference, no critic)
        proximal[budget] = gather_responses(samples, batches, logprobs)
        widths[budget] = (
            [b.input_ids.numel() for b in batches], [b.input_ids.numel() for b in backend.recorded_training]
        )  # fmt: skip
    assert max(widths[200][0]) > 40 and len(widths[200][0]) < len(widths[0][0])
    assert max(widths[0][0]) <= 40 or not packed
    assert widths[200][1] == widths[0][1]  # training's micro-batches are untouched
    assert torch.allclose(proximal[200], proximal[0], atol=1e-5)


def test_a_model_with_a_sliding_window_is_refused_rather_than_packed_without_it():
    from streamrl.backends.documents import document_attention

    query = torch.zeros(1, 2, 4, 8)
    with pytest.raises(NotImplementedError, match=r"learner\.pack_sequences = false"):
        document_attention(
            torch.nn.Module(), query, query, query, None, position_ids=torch.arange(4)[None],
            sliding_window=2,
        )  # fmt: skip
