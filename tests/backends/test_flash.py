"""`learner.flash_attention` (`streamrl.backends.flash`): which kernels are chosen where, and
that the two attentions that call FlashAttention-4 hand it their tensors in its layout.

FlashAttention-4 runs on Hopper and Blackwell GPUs only (bench/gpu/flash_check.py compares it
with torch's kernels on the H200). Here a stand-in module with FlashAttention-4's two entry
points, computed by SDPA on each sequence, takes its place, so that the Megatron core
attention's and the packed rows' reshapes around it are checked against torch's own path."""

from __future__ import annotations

import itertools
import types

import pytest
import torch
import torch.nn.functional as F

from streamrl.backends import documents, flash


@pytest.fixture
def fa4_stand_in(monkeypatch):
    """FlashAttention-4's entry points (token-major [.., S, heads, d], grouped key/value
    heads, causal) by SDPA, recording each call's shapes; `fa4_serves` true on the CPU."""
    calls = []

    def attend(q, k, v, scale):  # [S, heads, d] each -> [S, heads, d]
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True,
            scale=scale, enable_gqa=k.shape[1] != q.shape[1],
        )  # fmt: skip
        return out.transpose(0, 1)

    def flash_attn_func(q, k, v, *, softmax_scale, causal):
        assert causal
        calls.append(("dense", q.shape, k.shape))
        out = torch.stack([attend(q[b], k[b], v[b], softmax_scale) for b in range(q.shape[0])])
        return out, None

    def flash_attn_varlen_func(q, k, v, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                               max_seqlen_k, softmax_scale, causal):  # fmt: skip
        assert causal and cu_seqlens_q is cu_seqlens_k and max_seqlen_q == max_seqlen_k
        calls.append(("varlen", q.shape, k.shape, cu_seqlens_q.tolist()))
        spans = list(itertools.pairwise(cu_seqlens_q.tolist()))
        assert max_seqlen_q == max(b - a for a, b in spans)
        parts = [attend(q[a:b], k[a:b], v[a:b], softmax_scale) for a, b in spans]
        return torch.cat(parts), None

    module = types.SimpleNamespace(
        flash_attn_func=flash_attn_func, flash_attn_varlen_func=flash_attn_varlen_func
    )
    monkeypatch.setattr(flash, "_STATE", {"packed": True, "rows": True, "module": module})
    monkeypatch.setattr(flash, "fa4_serves", lambda query, value, dropout=0.0, *, packed: True)
    return calls


def test_auto_keeps_torchs_kernels_on_the_cpu_and_fa4_there_is_refused_naming_the_key():
    cpu = torch.device("cpu")
    assert flash.choose("auto", cpu) == "torch" == flash.kernel()
    assert flash.choose("torch", cpu) == "torch"
    with pytest.raises(ValueError, match=r"learner\.flash_attention = 'fa4'.*CUDA GPUs only"):
        flash.choose("fa4", cpu)
    with pytest.raises(ValueError, match=r"learner\.flash_attention = 'fa3' is not one of"):
        flash.choose("fa3", cpu)
    query = torch.zeros(1, 1, 8, dtype=torch.bfloat16)
    assert not flash.fa4_serves(query, query, packed=True)


def test_auto_gives_fa4_packed_rows_only_and_fa4_gives_it_every_row(monkeypatch):
    """Where FlashAttention-4 can run, `auto` uses it for packed rows (where it was faster on
    the H200) and `fa4` for right-padded rows too; `torch` for neither."""
    module = types.SimpleNamespace(name="the FlashAttention-4 interface")
    monkeypatch.setattr(flash, "_STATE", dict(flash._STATE))
    monkeypatch.setattr(flash, "fa4_problem", lambda device: None)
    monkeypatch.setattr(flash.importlib, "import_module", lambda name: module)
    cuda = torch.device("cuda", 0)
    chosen = {
        setting: (flash.choose(setting, cuda), dict(flash._STATE)) for setting in flash.SETTINGS
    }
    assert chosen == {
        "auto": ("fa4 for packed rows", {"packed": True, "rows": False, "module": module}),
        "fa4": ("fa4", {"packed": True, "rows": True, "module": module}),
        "torch": ("torch", {"packed": False, "rows": False, "module": None}),
    }


def test_the_config_key_takes_the_three_settings_and_refuses_others_naming_it():
    from streamrl.config import ConfigError
    from streamrl.config.loading import config_from_dict

    data = {"path": "builtin:arithmetic"}
    assert config_from_dict({"data": data}).learner.flash_attention == "auto"
    chosen = config_from_dict({"data": data, "learner": {"flash_attention": "fa4"}})
    assert chosen.learner.flash_attention == "fa4"
    with pytest.raises(ConfigError, match=r"learner\.flash_attention"):
        config_from_dict({"data": data, "learner": {"flash_attention": "fa3"}})


def _qkv(seed: int, *, batch: int, seq: int, heads: int, groups: int, dim: int):
    generator = torch.Generator().manual_seed(seed)
    return (
        torch.randn(seq, batch, heads, dim, generator=generator),
        torch.randn(seq, batch, groups, dim, generator=generator),
        torch.randn(seq, batch, groups, dim, generator=generator),
    )


def test_megatron_core_attention_hands_fa4_its_rows_and_takes_back_torchs_layout(fa4_stand_in):
    pytest.importorskip("megatron.core")
    from streamrl.backends.megatron.layers import SdpaAttention

    config = types.SimpleNamespace(context_parallel_size=1, kv_channels=8, attention_dropout=0.0)
    attention = SdpaAttention(config, 1, None, "self")
    query, key, value = _qkv(0, batch=3, seq=7, heads=4, groups=2, dim=8)
    through_fa4 = attention(query, key, value, None)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(flash, "fa4_serves", lambda query, value, dropout=0.0, *, packed: False)
        through_torch = attention(query, key, value, None)
    assert fa4_stand_in == [("dense", (3, 7, 4, 8), (3, 7, 2, 8))]
    assert through_fa4.shape == through_torch.shape == (7, 3, 32)
    torch.testing.assert_close(through_fa4, through_torch, rtol=0, atol=1e-6)


def test_packed_rows_hand_fa4_every_sample_as_one_sequence(fa4_stand_in):
    query, key, value = (t.permute(1, 2, 0, 3) for t in _qkv(1, batch=2, seq=9, heads=4,
                                                             groups=2, dim=8))  # fmt: skip
    spans = [[(0, 4), (4, 9)], [(0, 2), (2, 3), (3, 9)]]
    through_fa4 = documents.attend_within_samples(query, key, value, spans, scale=0.3)
    assert fa4_stand_in == [("varlen", (18, 4, 8), (18, 2, 8), [0, 4, 9, 11, 12, 18])]
    for row, row_spans in enumerate(spans):
        for start, end in row_spans:
            alone = F.scaled_dot_product_attention(
                query[row : row + 1, :, start:end], key[row : row + 1, :, start:end],
                value[row : row + 1, :, start:end], is_causal=True, scale=0.3, enable_gqa=True,
            )  # fmt: skip
            torch.testing.assert_close(through_fa4[row : row + 1, :, start:end], alone)


def test_a_varlen_kernel_that_fails_is_left_out_and_the_next_one_serves_packed_rows(monkeypatch):
    """FlashAttention-4 raising on a packed micro-batch hands it to torch's variable-length
    kernel (here a stand-in: causal SDPA per cumulative span), not to SDPA per sample, and
    is not called again."""
    fa4_calls, torch_calls = [], []

    def failing_fa4(*args, **kwargs):
        fa4_calls.append(1)
        raise RuntimeError("this GPU's FlashAttention-4 refuses the input")

    def torch_varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, scale, **options):
        torch_calls.append(cu_q.tolist())
        out = torch.empty_like(q)
        for start, end in itertools.pairwise(cu_q.tolist()):
            out[start:end] = F.scaled_dot_product_attention(
                q[start:end].transpose(0, 1), k[start:end].transpose(0, 1),
                v[start:end].transpose(0, 1), is_causal=True, scale=scale, enable_gqa=True,
            ).transpose(0, 1)  # fmt: skip
        return out

    monkeypatch.setattr(documents, "_BROKEN", {})
    monkeypatch.setattr(flash, "fa4_serves", lambda query, value, dropout=0.0, *, packed: True)
    monkeypatch.setattr(flash, "fa4_varlen", failing_fa4)
    monkeypatch.setattr(documents, "_torch_varlen_serves", lambda query, value: True)
    state = {"function": torch_varlen, "causal": {"window_size": (-1, 0)}, "gqa": True}
    monkeypatch.setattr(documents, "_VARLEN", state)
    query, key, value = (t.permute(1, 2, 0, 3) for t in _qkv(2, batch=2, seq=9, heads=4,
                                                             groups=2, dim=8))  # fmt: skip
    spans = [[(0, 4), (4, 9)], [(0, 9)]]
    first = documents.attend_within_samples(query, key, value, spans, scale=0.3)
    second = documents.attend_within_samples(query, key, value, spans, scale=0.3)
    assert fa4_calls == [1] and torch_calls == [[0, 4, 9, 18]] * 2
    assert documents._BROKEN == {
        "fa4": "RuntimeError: this GPU's FlashAttention-4 refuses the input"
    }
    with monkeypatch.context() as patch:  # every kernel out: SDPA per sample
        patch.setattr(documents, "_torch_varlen_serves", lambda query, value: False)
        per_sample = documents.attend_within_samples(query, key, value, spans, scale=0.3)
    torch.testing.assert_close(first, per_sample)
    torch.testing.assert_close(second, per_sample)
