"""The agents room's fixtures: SmolLM2's tokenizer (its chat template renders the prompts
these tests check) and one embedded engine on the tiny model, each once per module."""

from __future__ import annotations

import pytest
from engine_helpers import running_engines


@pytest.fixture(scope="module")
def tokenizer():
    from streamrl.models import load_tokenizer

    return load_tokenizer("smollm2")


@pytest.fixture(scope="module")
def engine_url(tiny_model_dir, tmp_path_factory):
    with running_engines(tiny_model_dir, tmp_path_factory.mktemp("engine")) as engines:
        yield engines[0].url
