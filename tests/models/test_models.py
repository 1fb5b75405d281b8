"""Model sources: seeded random shapes, save/load round trips, SmolLM2 from its GGUF."""

from __future__ import annotations

import time

import pytest

torch = pytest.importorskip("torch")

from streamrl import models  # noqa: E402
from streamrl.models import devices  # noqa: E402


def _same_weights(a, b) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("shape", ["llama-tiny", "qwen2-tiny", "qwen3-tiny"])
def test_a_random_shape_builds_identical_weights_for_one_seed(shape):
    first = models.load_causal_lm(f"random:{shape}", seed=3)
    second = models.load_causal_lm(f"random:{shape}", seed=3)
    other = models.load_causal_lm(f"random:{shape}", seed=4)
    assert _same_weights(first, second)
    assert not _same_weights(first, other)


def test_random_shapes_have_the_promised_structure():
    llama = models.random_config("llama-tiny")
    qwen2 = models.random_config("qwen2-tiny")
    qwen3 = models.random_config("qwen3-tiny")
    assert llama.tie_word_embeddings and llama.vocab_size == 49152
    assert (qwen2.num_attention_heads, qwen2.num_key_value_heads) == (4, 2)
    model = models.load_causal_lm("random:qwen2-tiny")
    assert model.model.layers[0].self_attn.q_proj.bias is not None
    model = models.load_causal_lm("random:qwen3-tiny")
    assert hasattr(model.model.layers[0].self_attn, "q_norm")
    assert qwen3.model_type == "qwen3"
    big = models.random_config("qwen2-0.5b")
    assert (big.num_hidden_layers, big.hidden_size, big.vocab_size) == (24, 896, 151936)


def test_an_unknown_random_shape_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown random shape"):
        models.random_config("gpt-huge")


def test_a_saved_random_model_loads_back_with_the_same_weights(tmp_path):
    path = models.save_random_model("qwen3-tiny", tmp_path / "m", seed=5)
    loaded, tokenizer = models.load_model(str(path))
    built = models.load_causal_lm("random:qwen3-tiny", seed=5)
    assert _same_weights(loaded, built)
    assert tokenizer.decode(tokenizer.encode("hello world")) == "hello world"


def test_random_weights_are_drawn_once_per_machine_and_each_run_gets_its_own_copy(
    tmp_path, monkeypatch
):
    monkeypatch.setenv("STREAMRL_CACHE_DIR", str(tmp_path / "cache"))
    first = models.save_random_model("llama-tiny", tmp_path / "a", seed=5)
    cached = models.random_model_dir("llama-tiny", seed=5)
    assert cached.parent == tmp_path / "cache" and cached.name.startswith("random-llama-tiny-")
    drawn, build = [], models.build_random_model

    def counted(shape, **kwargs):
        drawn.append(shape)
        return build(shape, **kwargs)

    monkeypatch.setattr(models, "build_random_model", counted)
    second = models.save_random_model("llama-tiny", tmp_path / "b", seed=5)
    assert drawn == []  # the second run copies what the first drew
    assert models.random_model_dir("llama-tiny", seed=6) != cached  # the seed is in the key
    assert drawn == ["llama-tiny"]
    files = sorted(p.name for p in first.iterdir())
    assert files == sorted(p.name for p in second.iterdir()) and "config.json" in files
    (second / "config.json").write_text("{}")  # a run's copy is its own
    assert (cached / "config.json").read_text() != "{}"


def test_random_weights_saved_in_bfloat16_are_the_float32_draw_rounded_and_load_back(
    tmp_path, monkeypatch
):
    monkeypatch.setenv("STREAMRL_CACHE_DIR", str(tmp_path / "cache"))
    path = models.save_random_model("qwen3-tiny", tmp_path / "m", seed=5, dtype="bf16")
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), framework="pt") as saved:
        dtypes = {saved.get_slice(name).get_dtype() for name in saved.keys()}  # noqa: SIM118
    assert dtypes == {"BF16"}
    assert models.model_config(str(path)).dtype == torch.bfloat16
    loaded = models.load_causal_lm(str(path), dtype=torch.bfloat16)
    built = models.load_causal_lm("random:qwen3-tiny", seed=5, dtype=torch.bfloat16)
    assert _same_weights(loaded, built)
    fp32 = models.random_model_dir("qwen3-tiny", seed=5)
    assert fp32 != models.random_model_dir("qwen3-tiny", seed=5, dtype="bfloat16")
    cached = sorted(p.name.rpartition("-")[0] for p in (tmp_path / "cache").glob("random-*"))
    assert cached == ["random-qwen3-tiny", "random-qwen3-tiny-bf16"]


def test_full_size_shapes_are_saved_in_bfloat16_unless_asked_otherwise():
    from streamrl.models.shapes import saved_dtype

    assert [saved_dtype(s) for s in ("qwen3-4b", "llama3-8b", "glm4-9b")] == ["bfloat16"] * 3
    assert saved_dtype("qwen3-tiny") == "float32"
    assert saved_dtype("qwen3-4b", "fp32") == "float32"
    assert saved_dtype("qwen3-tiny", "bf16") == "bfloat16"
    with pytest.raises(ValueError, match="unknown dtype"):
        saved_dtype("qwen3-tiny", "int8")


def test_a_checkpoint_is_read_from_its_files_as_transformers_would_load_it(tmp_path):
    model = models.load_causal_lm("random:llama-tiny", seed=2)
    model.save_pretrained(tmp_path / "whole")
    model.save_pretrained(tmp_path / "sharded", max_shard_size="1MB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    expected = model.state_dict()
    for directory in ("whole", "sharded"):
        read = models.read_checkpoint(str(tmp_path / directory))
        # A tied head is saved once, as the embedding.
        assert set(read) == set(expected) - {"lm_head.weight"}
        assert all(torch.equal(read[name], expected[name]) for name in read)
        assert all(tensor.dtype == torch.float32 for tensor in read.values())
    assert models.read_checkpoint("random:llama-tiny") is None
    assert models.read_checkpoint(str(tmp_path)) is None  # no model files there


def test_dtype_and_device_names_resolve():
    assert devices.resolve_dtype("auto", "cpu") == torch.float32
    assert devices.resolve_dtype("auto", "cuda") == torch.bfloat16
    assert devices.resolve_dtype("bf16", "cpu") == torch.bfloat16
    assert devices.resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(ValueError):
        devices.resolve_dtype("float7", "cpu")


def test_the_smollm2_gguf_is_found_without_importing_its_package():
    path = models.smollm2_gguf_path()
    assert path.suffix == ".gguf" and path.stat().st_size > 10_000_000


@pytest.mark.slow
def test_smollm2_loads_from_its_gguf_and_answers(tmp_path, monkeypatch):
    """The first load dequantises (~7 s on 2 cores); the cached copy loads in well under 1 s."""
    monkeypatch.setenv("STREAMRL_CACHE_DIR", str(tmp_path))
    start = time.perf_counter()
    model, tokenizer = models.load_model("smollm2")
    first_s = time.perf_counter() - start
    start = time.perf_counter()
    model, tokenizer = models.load_model("smollm2")
    cached_s = time.perf_counter() - start
    assert cached_s < first_s
    assert model.config.tie_word_embeddings
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2+2?"}], add_generation_prompt=True, return_dict=False
    )
    out = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)
    assert "4" in tokenizer.decode(out[0, len(ids) :])


def test_random_models_fall_back_to_a_byte_tokenizer_without_smollm2(monkeypatch):
    def missing():
        raise FileNotFoundError("SmolLM2 is not installed")

    monkeypatch.setattr(models, "smollm2_gguf_path", missing)
    tokenizer = models.load_tokenizer("random:qwen2-tiny")
    assert tokenizer.eos_token_id == 2
    ids = tokenizer.encode("héllo")
    assert tokenizer.decode(ids) == "héllo" and max(ids) < 259


@pytest.mark.parametrize("source", ["random:qwen3-tiny", "qwen3 dir", "llama dir"])
def test_the_class_autotokenizer_resolved_loads_the_same_tokenizer_without_it(
    source, tiny_model_dir, tiny_llama_dir
):
    """What the rollout process does with the class the trainer resolved (it then imports no
    torch): the same class, files, settings and outputs as AutoTokenizer's."""
    path = {"qwen3 dir": tiny_model_dir, "llama dir": tiny_llama_dir}.get(source, source)
    auto = models.load_tokenizer(path)
    direct = models.load_tokenizer(path, resolved_class=type(auto).__name__)
    assert type(auto).__name__ == models.FAST_TOKENIZER_CLASS and type(direct) is type(auto)
    assert direct.backend_tokenizer.to_str() == auto.backend_tokenizer.to_str()
    assert direct.init_kwargs == auto.init_kwargs
    public = {k: v for k, v in vars(auto).items() if not k.startswith("_")}
    assert {k: v for k, v in vars(direct).items() if not k.startswith("_")} == public
    chat = [{"role": "user", "content": "What is 2 + 3?"}]
    rendered = auto.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert direct.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) == rendered
    ids = auto.encode(rendered + " héllo wörld 123")
    assert direct.encode(rendered + " héllo wörld 123") == ids
    assert direct.decode(ids) == auto.decode(ids)
