"""The Megatron backend's per-token log-probabilities and entropy, a chunk of rows at a time:
values and gradients equal plain log-softmax's whatever the chunk size. (TP 2 against the
full vocabulary is in tests/backends/megatron/test_megatron.py.)"""

from __future__ import annotations

import pytest
import torch

from streamrl.backends.megatron import logprobs as megatron_logprobs


def _truth(logits, input_ids, temperature):
    """float64 log-softmax: log p of each next token and the entropy, position 0 = 0."""
    scaled = logits.double()[:, :-1] / temperature
    log_p = torch.log_softmax(scaled, dim=-1)
    picked = log_p.gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    entropy = -(log_p.exp() * log_p).sum(-1)
    zero = picked.new_zeros(logits.shape[0], 1)
    return torch.cat([zero, picked], 1), torch.cat([zero, entropy], 1)


@pytest.mark.parametrize("chunk_rows", [1, 3, 1000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_logprobs_entropy_and_their_gradients_equal_log_softmax(
    monkeypatch, chunk_rows, dtype
):
    vocab, temperature = 97, 0.7
    monkeypatch.setattr(megatron_logprobs, "CHUNK_BYTES", chunk_rows * 4 * vocab)
    generator = torch.Generator().manual_seed(3)
    logits = (torch.randn(2, 11, vocab, generator=generator) * 3).to(dtype)
    input_ids = torch.randint(0, vocab, (2, 11), generator=generator)
    mask = torch.ones(2, 11, dtype=torch.int64)
    mask[1, 8:] = 0  # padding holds 0
    weights = torch.randn(2, 2, 11, generator=generator, dtype=torch.float64)

    truth_in = logits.detach().double().requires_grad_(True)
    lp_truth, ent_truth = _truth(truth_in, input_ids, temperature)
    keep = torch.cat([mask.new_zeros(2, 1), mask[:, 1:]], 1).double()
    lp_truth, ent_truth = lp_truth * keep, ent_truth * keep
    ((lp_truth * weights[0]).sum() + (ent_truth * weights[1]).sum()).backward()

    ours_in = logits.detach().clone().requires_grad_(True)
    lp, ent = megatron_logprobs.token_logprobs_and_entropy(
        ours_in, input_ids, mask, vocab_start=0, temperature=temperature, need_entropy=True
    )
    ((lp * weights[0]).sum() + (ent * weights[1]).sum()).backward()

    tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: the gradient is stored in bf16
    assert lp.dtype == torch.float32 and lp.shape == (2, 11)
    assert torch.allclose(lp.double(), lp_truth, atol=1e-5)
    assert torch.allclose(ent.double(), ent_truth, atol=1e-5)
    assert ours_in.grad.dtype == dtype
    assert torch.allclose(ours_in.grad.double(), truth_in.grad, atol=tol)


def test_without_entropy_the_logprob_gradient_alone_is_right():
    vocab = 50
    generator = torch.Generator().manual_seed(5)
    logits = torch.randn(1, 6, vocab, generator=generator).requires_grad_(True)
    input_ids = torch.randint(0, vocab, (1, 6), generator=generator)
    mask = torch.ones(1, 6, dtype=torch.int64)
    lp, ent = megatron_logprobs.token_logprobs_and_entropy(
        logits, input_ids, mask, vocab_start=0, need_entropy=False
    )
    assert ent is None
    lp.sum().backward()

    truth_in = logits.detach().double().requires_grad_(True)
    lp_truth, _ = _truth(truth_in, input_ids, 1.0)
    lp_truth.sum().backward()
    assert torch.allclose(lp.double(), lp_truth, atol=1e-6)
    assert torch.allclose(logits.grad.double(), truth_in.grad, atol=1e-6)


def test_a_target_outside_this_ranks_slice_contributes_no_logit():
    """With vocab_start past every target (another TP rank owns them) and no group, the
    log-probability is -log S of this slice alone: the target's logit counts as 0."""
    logits = torch.zeros(1, 3, 4)
    input_ids = torch.tensor([[0, 1, 2]])
    mask = torch.ones(1, 3, dtype=torch.int64)
    lp, _ = megatron_logprobs.token_logprobs_and_entropy(logits, input_ids, mask, vocab_start=10)
    log_4 = torch.log(torch.tensor(4.0)).item()
    assert torch.allclose(lp, torch.tensor([[0.0, -log_4, -log_4]]))


def test_an_entropy_that_feeds_no_gradient_leaves_the_logprob_gradient_unchanged():
    """The entropy as a metric only (no entropy bonus): its gradient is not materialised,
    and the logits' gradient is the log-probabilities' alone."""
    vocab = 40
    generator = torch.Generator().manual_seed(6)
    logits = torch.randn(2, 5, vocab, generator=generator)
    input_ids = torch.randint(0, vocab, (2, 5), generator=generator)
    mask = torch.ones(2, 5, dtype=torch.int64)
    grads = []
    for need_entropy in (False, True):
        leaf = logits.clone().requires_grad_(True)
        lp, _ = megatron_logprobs.token_logprobs_and_entropy(
            leaf, input_ids, mask, vocab_start=0, need_entropy=need_entropy
        )
        lp.sum().backward()
        grads.append(leaf.grad)
    assert torch.equal(grads[0], grads[1])


def test_compiled_logprobs_entropy_and_gradients_equal_the_plain_path():
    """torch.compile'd row kernels (CUDA's default) against the plain ones, float32 on CPU.

    Both evaluate the same formulas; only rounding differs (sums in another order, fused
    multiply-adds, another exp). Each path's sum S of V positive terms is within
    gamma_V ~ V u of the exact one (u = 2^-24), so log S and log p(y) differ by at most
    2 (V + 2) u plus the rounding of x - m, 2 u |x - m|; the entropy's weighted sum is one
    of same-signed terms too. A gradient element p_i (a + b (log p_i + H)) then differs by
    p_i times that, scaled by the upstream weights a, b."""
    vocab, temperature = 1000, 0.7
    generator = torch.Generator().manual_seed(7)
    logits = torch.randn(2, 9, vocab, generator=generator) * 3
    input_ids = torch.randint(0, vocab, (2, 9), generator=generator)
    mask = torch.ones(2, 9, dtype=torch.int64)
    mask[0, 6:] = 0
    weights = torch.randn(2, 2, 9, generator=generator)
    results = []
    for compiled in (False, True):
        leaf = logits.clone().requires_grad_(True)
        lp, ent = megatron_logprobs.token_logprobs_and_entropy(
            leaf, input_ids, mask, vocab_start=0, temperature=temperature,
            need_entropy=True, compiled=compiled,
        )  # fmt: skip
        ((lp * weights[0]).sum() + (ent * weights[1]).sum()).backward()
        results.append((lp.detach(), ent.detach(), leaf.grad))
    u = 2.0**-24
    spread = (logits / temperature).amax(-1) - (logits / temperature).amin(-1)
    value_tol = 2 * (vocab + 2) * u + 2 * u * float(spread.max())
    upstream = float(weights.abs().max()) * (2 + float(spread.max()) + float(results[0][1].max()))
    for plain, fused in zip(results[0], results[1], strict=True):
        assert plain.shape == fused.shape and plain.dtype == fused.dtype
    (lp0, ent0, grad0), (lp1, ent1, grad1) = results
    assert (lp0 - lp1).abs().max() <= value_tol
    assert (ent0 - ent1).abs().max() <= value_tol * 3
    assert (grad0 - grad1).abs().max() <= value_tol * upstream / temperature
