"""`import streamrl` and `streamrl --help` stay light: no torch, Megatron, transformers or SGLang."""

from __future__ import annotations

import subprocess
import sys

HEAVY = ("torch", "transformers", "megatron", "sglang", "ray")


def loaded_after(code: str) -> set[str]:
    probe = f"{code}\nimport sys\nprint(' '.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    return {name.split(".")[0] for name in out.stdout.split()}


def test_importing_streamrl_and_its_config_loads_no_heavy_package():
    loaded = loaded_after(
        "import streamrl, streamrl.config, streamrl.types, streamrl.queues.buffer"
    )
    assert not loaded & set(HEAVY)


def test_streamrl_help_loads_no_heavy_package():
    loaded = loaded_after(
        "import sys\nfrom streamrl.cli import build_parser\n"
        "try:\n    build_parser().parse_args(['--help'])\nexcept SystemExit:\n    pass"
    )
    assert not loaded & set(HEAVY)
