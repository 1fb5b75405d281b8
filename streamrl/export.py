"""`streamrl export`: a LoRA run's checkpoint as peft's adapter and as merged HF weights.

    streamrl export runs/x/checkpoints/step_000016 --out exported/ [--base MODEL] [--no-merged]

writes

    exported/adapter/   the adapter in peft's format (adapter_config.json,
                        adapter_model.safetensors, the tokenizer): `PeftModel.from_pretrained`
                        or SGLang's `--lora-paths` load it on top of the base model
    exported/merged/    the base with the adapter merged in (W + alpha / rank * B @ A) as a
                        plain Hugging Face model directory (float32), for any engine

The base is `--base`, else the adapter's `base_model_name_or_path` (the run's initial
model: a Hugging Face directory, `smollm2`, or the run's `initial_model/` for `random:`
shapes). A LoRA checkpoint of either learner backend is already a peft adapter directory;
the merge runs through peft itself (`merge_and_unload`).
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from streamrl.models import TOKENIZER_FILES
from streamrl.weights import adapters

_ADAPTER_FILES = (adapters.CONFIG_FILE, adapters.WEIGHTS_FILE)


def export_adapter(checkpoint: Path, out: Path) -> Path:
    """Copy the peft adapter (and tokenizer) files of a LoRA checkpoint into `out`."""
    if not adapters.is_peft_adapter(checkpoint):
        raise FileNotFoundError(
            f"{checkpoint} holds no LoRA adapter ({adapters.CONFIG_FILE}): only checkpoints of "
            f"runs with learner.lora.rank > 0 export as adapters"
        )
    adapters.read_peft_adapter(checkpoint)  # refuses what is not a plain LoRA adapter
    out.mkdir(parents=True, exist_ok=True)
    for name in (*_ADAPTER_FILES, *TOKENIZER_FILES):
        if (checkpoint / name).exists():
            shutil.copy(checkpoint / name, out / name)
    return out


def export_merged(adapter_dir: Path, out: Path, *, base: str = "") -> Path:
    """The base model with the adapter of `adapter_dir` merged in, as an HF directory."""
    import torch
    from peft import PeftModel

    from streamrl.models import load_model

    spec, _ = adapters.read_peft_adapter(adapter_dir)
    base = base or spec.base_model
    if not base:
        raise ValueError(f"{adapter_dir}: the adapter names no base model; pass --base")
    model, tokenizer = load_model(base, device="cpu", dtype=torch.float32)
    merged = PeftModel.from_pretrained(model, str(adapter_dir)).merge_and_unload()
    out.mkdir(parents=True, exist_ok=True)
    merged.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def export_command(args) -> int:
    checkpoint, out = Path(args.checkpoint), Path(args.out)
    try:
        adapter = export_adapter(checkpoint, out / "adapter")
        print(f"adapter (peft format): {adapter}")
        if args.merged:
            merged = export_merged(adapter, out / "merged", base=args.base)
            print(f"merged Hugging Face model: {merged}")
    except (FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0
