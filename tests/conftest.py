"""The suite's shared fixtures (free ports, a tiny random model on disk, the anyio
backend) and how pytest-xdist spreads it over its workers.

The tests live in rooms that mirror the package: actors/, agents/, algorithms/,
backends/ (with backends/megatron/), bench/, compat/, config/, engine/, fleet/, launch/,
models/, planner/, queues/, rewards/, tasks/, weights/; runs/ holds the end-to-end `streamrl run`
tests, conformance/ the engine protocol suite that runs against both engines, house/ the
checks on the repository itself (docs, import layers, lock). Scaffolding that several
rooms share sits here, at the top: `engine_helpers` (engine processes), `run_helpers`
(`streamrl run` and what a run leaves); a room's own scaffolding sits in the room. User
code that configs name as `tests.<module>:<function>` (`e2e_rewards`, `e2e_generate`,
`e2e_filters`, `gateway_agents`, `slime_functions`) also sits here, importable by the
run's child processes from the repository root."""

from __future__ import annotations

import pytest

from streamrl.process import free_port as _free_port


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def free_port():
    """A function returning a fresh free TCP port on 127.0.0.1 each call."""
    return _free_port


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """A random Qwen3-shaped model (a few MB) saved as a Hugging Face directory."""
    from streamrl.models import save_random_model

    path = tmp_path_factory.mktemp("models") / "qwen3-tiny"
    save_random_model("qwen3-tiny", path, seed=0)
    return str(path)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> str:
    """A random Llama-shaped model saved as a Hugging Face directory."""
    from streamrl.models import save_random_model

    path = tmp_path_factory.mktemp("models") / "llama-tiny"
    save_random_model("llama-tiny", path, seed=0)
    return str(path)


@pytest.fixture(scope="session")
def tiny_engine(tiny_model_dir, tmp_path_factory):
    """One `streamrl engine serve` on `tiny_model_dir` (default arguments) for every test that
    asks for it, started on first use; `_tiny_engine_put_back` restores it after each test.
    Tests whose assertions need a fresh engine (counters from zero, shutdown, other
    arguments) start their own with `engine_helpers.running_engines`."""
    from engine_helpers import SharedEngine

    engine = SharedEngine(tiny_model_dir, tmp_path_factory.mktemp("tiny-engine"))
    yield engine
    engine.stop()


@pytest.fixture(autouse=True)
def _tiny_engine_put_back(request):
    """After each test that used `tiny_engine`, directly or through another fixture: the
    engine running, idle, on the checkpoint and weight version it started with."""
    if "tiny_engine" not in request.fixturenames:
        yield
        return
    engine = request.getfixturevalue("tiny_engine")
    yield
    engine.put_back()


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Under pytest-xdist (`make test` runs `-n 2 --dist loadgroup`), each module is one
    group, so its tests share one worker and its module fixtures (a running engine, a
    trained model) are built once. Modules marked `xdist_group("ray")` share one group
    instead: they start Ray instances and count Ray's daemons machine-wide, so two of them
    must not run at once. Without xdist the marks change nothing."""
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))
