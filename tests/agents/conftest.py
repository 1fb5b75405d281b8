"""The agents room's fixtures: SmolLM2's tokenizer (its chat template renders the prompts
these tests check), once per module, and the URL of the session's shared embedded engine on the
tiny model (`tiny_engine`)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def tokenizer():
    from streamrl.models import load_tokenizer

    return load_tokenizer("smollm2")


@pytest.fixture
def engine_url(tiny_engine) -> str:
    return tiny_engine.url
