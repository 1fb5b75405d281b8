"""The machine's model cache: converted and drawn models, built once, shared by every run.

    $STREAMRL_CACHE_DIR (default ~/.cache/streamrl)/
      smollm2-<key of the GGUF's content>/{model,tokenizer}   `streamrl.models.smollm2`
      random-<shape>-<key of what the weights depend on>/       `random_model_dir`

A directory is built in a temporary sibling and renamed into place, so a reader never
sees half of one and concurrent builders are harmless. Deleting the cache is safe: what
a run needs is built again.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path


def cache_root() -> Path:
    """Where converted models live: ``$STREAMRL_CACHE_DIR`` or ``~/.cache/streamrl``."""
    return Path(os.environ.get("STREAMRL_CACHE_DIR") or Path.home() / ".cache" / "streamrl")


def publish_dir(build, final: Path) -> Path:
    """Build a directory in a temporary sibling, then rename it into place (atomic).

    Concurrent builders are harmless: the first rename wins and later ones are dropped.
    """
    if final.is_dir():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        with quiet_progress():
            build(staging)
        with contextlib.suppress(OSError):
            os.rename(staging, final)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    if not final.is_dir():
        raise RuntimeError(f"could not publish {final}")
    return final


@contextlib.contextmanager
def quiet_progress():
    """Silence transformers' per-load progress bars (engines load often; logs stay readable)."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()
