"""Fixtures of the conformance suite: the server under test, a router in front of it, a teacher.

By default the suite runs against the session's shared embedded engine on a tiny
random model (`tiny_engine`), put back as it started after every test. To check a real
SGLang server instead:

    STREAMRL_CONFORMANCE_URL=http://host:30000 STREAMRL_CONFORMANCE_MODEL=/path/to/model \\
        pytest tests/conformance

The other `STREAMRL_CONFORMANCE_*` settings (BACKEND, MASTER_ADDRESS, DTYPE,
LOGPROB_TOL, LONG_TOKENS, SETTLE_S) and their defaults are in docs/conformance.md.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from conformance_support import Target, Teacher, load_teacher

from streamrl.fleet.router import Router

ENV = "STREAMRL_CONFORMANCE_"


def _env(name: str, default: str) -> str:
    return os.environ.get(ENV + name) or default


# Defaults that differ between the embedded engine on a CPU and a real server on GPUs.
_EMBEDDED = {"BACKEND": "gloo", "LOGPROB_TOL": "1e-4", "LONG_TOKENS": "300", "DTYPE": "float32"}
_SERVER = {"BACKEND": "nccl", "LOGPROB_TOL": "0.05", "LONG_TOKENS": "2000", "DTYPE": "bfloat16"}


def _target(url: str, model_path: str | None, *, is_embedded: bool) -> Target:
    defaults = _EMBEDDED if is_embedded else _SERVER
    return Target(
        url=url.rstrip("/"),
        model_path=model_path,
        backend=_env("BACKEND", defaults["BACKEND"]),
        master_address=_env("MASTER_ADDRESS", "127.0.0.1"),
        logprob_tol=float(_env("LOGPROB_TOL", defaults["LOGPROB_TOL"])),
        long_tokens=int(_env("LONG_TOKENS", defaults["LONG_TOKENS"])),
        settle_s=float(_env("SETTLE_S", "1.0")),
        weights_dtype=_env("DTYPE", defaults["DTYPE"]),
    )


@pytest.fixture(scope="session")
def target(request) -> Target:
    """The server under test: `STREAMRL_CONFORMANCE_URL`, or the shared embedded engine."""
    url = os.environ.get(ENV + "URL")
    if url:
        return _target(url, os.environ.get(ENV + "MODEL") or None, is_embedded=False)
    engine = request.getfixturevalue("tiny_engine")
    return _target(engine.url, engine.model_dir, is_embedded=True)


@pytest.fixture(autouse=True)
def _tiny_engine_put_back(request):
    """Every test here reaches the server through `target`; the shared embedded engine is
    put back as it started after each (a real server is left to the tests themselves)."""
    if os.environ.get(ENV + "URL"):
        yield
        return
    engine = request.getfixturevalue("tiny_engine")
    yield
    engine.put_back()


@pytest.fixture(scope="session")
def router(target, tmp_path_factory) -> Iterator[Router]:
    """The real sglang-router with the server under test as its only worker (skipped where
    it is not installed: the H200 machine, whose carry limit leaves no room for its wheel)."""
    pytest.importorskip("sglang_router", reason="sglang-router is not installed")
    logs = tmp_path_factory.mktemp("conformance-router")
    with Router.start([target.url], log_path=logs / "router.log", policy="round_robin") as started:
        yield started


@pytest.fixture(scope="module", params=["direct", "router"])
def via(request, target) -> str:
    """Where `/generate` goes: the server itself, or sglang-router in front of it."""
    if request.param == "direct":
        return target.url
    return request.getfixturevalue("router").url


@pytest.fixture(scope="module")
def model_dir(target) -> str:
    """The served model as a local directory, or skip the test."""
    path = target.model_path or _served_model_dir(target.url)
    if path is None:
        pytest.skip(f"set {ENV}MODEL to the served model's directory (as this process sees it)")
    return path


def _served_model_dir(url: str) -> str | None:
    import httpx

    try:
        info = httpx.get(f"{url}/get_model_info", timeout=10).json()
    except (httpx.HTTPError, ValueError):
        return None
    path = info.get("model_path")
    return path if path and Path(path, "config.json").exists() else None


@pytest.fixture(scope="module")
def teacher(model_dir) -> Teacher:
    """The served model in float32 on this machine's CPU, for teacher-forced logprobs."""
    return load_teacher(model_dir)
