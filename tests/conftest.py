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

import gc
import re
import sys
from pathlib import Path

import pytest

from streamrl.process import free_port as _free_port

# A pytest process imports torch, transformers, megatron-core and Ray while it collects, a few
# hundred thousand objects that live as long as it does; at Python's default thresholds each
# full collection walks them all again. Here, in the suite's own processes only, full
# collections wait for 100 times more middle-generation ones (young cycles are still collected
# at once), and what collection imported is frozen out of the collector's walks.
_young, _middle, _ = gc.get_threshold()
gc.set_threshold(_young, _middle, 1000)


def pytest_collection_finish(session) -> None:
    gc.freeze()
    # Torch work in the suite's own processes runs on one thread: on a 2-core machine the other
    # core belongs to the other worker and the processes the tests start, and a second OpenMP
    # thread there spins waiting for its share (tests/models and tests/backends took 8% less
    # CPU on one thread). The processes the tests start set their own (`num_threads`).
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(1)


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


@pytest.fixture(scope="session")
def tiny_split_engine(tiny_model_dir, tmp_path_factory):
    """`tiny_engine` split in two processes (`--http-process on`: HTTP in one, the model in
    its child); tests that use it put it back themselves (`SharedEngine.put_back`)."""
    from engine_helpers import SharedEngine

    log_dir = tmp_path_factory.mktemp("tiny-split-engine")
    engine = SharedEngine(tiny_model_dir, log_dir, extra_args=["--http-process", "on"])
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


FIRST_ROOMS = (
    "tests/runs/",
    "tests/launch/",
    "tests/backends/megatron/",
    "tests/bench/",
    "tests/agents/",
    "tests/fleet/",
)
"""Rooms whose modules start runs, learner ranks, Ray instances or engines of their own: under
pytest-xdist their modules are handed out first, so that the last ones to run are short and
both workers finish at about the same time."""


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist's
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadgroup` (what `make test` uses) runs each module, with its module fixtures (a
    running engine, rank runs, a trained model), on one worker, and every module that names
    `pytest.mark.xdist_group("ray")` on the same worker as the others that do: they start Ray
    instances and count Ray's daemons machine-wide, so two of them must not run at once. The
    Megatron modules that fork ranks name `"megatron"`: one worker, one forkserver
    (tests/backends/megatron/conftest.py).

    pytest-xdist's own loadgroup reads the group from a suffix it writes into each test's
    node id, which pytest 9.2 no longer lets it change (pytest-xdist issue 1386): every test
    was scheduled alone, each worker built the module fixtures of the modules it touched, and
    Ray modules ran side by side. This scheduler takes the group from the module's source
    instead, on the controller, which sees node ids only."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    groups = ModuleGroups(config.rootpath)

    class ModuleGroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return groups.unit_of(nodeid)

        def _assign_work_unit(self, node) -> None:
            """Hand out the units of FIRST_ROOMS and named groups first, then the rest; in
            each, the units with more tests first."""
            unit = min(
                self.workqueue,
                key=lambda unit: (not groups.is_first(unit), -len(self.workqueue[unit])),
            )
            self.workqueue.move_to_end(unit, last=False)
            super()._assign_work_unit(node)

    return ModuleGroupScheduling(config, log)


class ModuleGroups:
    """A test's unit of scheduling: the xdist group its module names anywhere in its source
    (`pytest.mark.xdist_group("NAME")`), else its module."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.named: set[str] = set()
        self._units: dict[str, str] = {}

    def unit_of(self, nodeid: str) -> str:
        module = nodeid.split("::", 1)[0]
        if module not in self._units:
            source = (self.root / module).read_text()
            names = set(re.findall(r"xdist_group\(\s*[\"']([^\"']+)[\"']", source))
            if len(names) > 1:
                raise pytest.UsageError(f"{module} names several xdist groups: {sorted(names)}")
            self.named |= names
            self._units[module] = names.pop() if names else module
        return self._units[module]

    def is_first(self, unit: str) -> bool:
        return unit in self.named or unit.startswith(FIRST_ROOMS)
