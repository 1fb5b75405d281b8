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


def test_the_rollout_process_loads_its_code_and_tokenizer_without_torch(tiny_model_dir):
    """Given the tokenizer class and the model's limits the trainer resolved, the rollout
    process (`streamrl.mains.rollout` and what it imports to serve) needs no torch, which
    transformers' AutoTokenizer and AutoConfig import: about 1 s of CPU per start."""
    loaded = loaded_after(
        "from streamrl.cli import main\nfrom streamrl.mains import rollout\n"
        "import streamrl.actors.evaluator, streamrl.actors.rollout, streamrl.agents.api\n"
        "import streamrl.data.source, streamrl.fleet.engine_set, streamrl.queues.sender\n"
        "import streamrl.rewards, streamrl.actors.failures, streamrl.data.rows\n"
        "from streamrl.models import load_tokenizer\n"
        f"load_tokenizer({tiny_model_dir!r}, resolved_class='TokenizersBackend')"
    )
    assert "transformers" in loaded and "torch" not in loaded
