"""The package's imports go one way: a walk of every module's import statements (ast, so
imports inside functions count too) fails on an import circle or on a direction this file
forbids. docs/architecture.md draws the same layers."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "streamrl"

LEAVES = ("streamrl.types", "streamrl.utils", "streamrl.process", "streamrl.placement")
LEAVES += ("streamrl.models", "streamrl.schedules", "streamrl.metrics")
LEAVES += ("streamrl.checkpoint", "streamrl.logs", "streamrl.events", "streamrl.memory_use")

ALLOWED: dict[str, tuple[str, ...]] = {
    # the wire types, the process helpers, placement, model shapes: nothing of streamrl
    **{leaf: () for leaf in LEAVES},
    "streamrl.algorithms": (),  # pure functions on tensors
    "streamrl.plot": ("streamrl.metrics",),
    "streamrl.config": ("streamrl.placement",),
    "streamrl.rewards": ("streamrl.utils",),
    # the weight wire, from both ends
    "streamrl.weights": ("streamrl.process",),  # free_port for a stage's rendezvous
    # the stream and the buffer: the wire types (and import_object, for user filters)
    "streamrl.queues": ("streamrl.types",),
    # the embedded engine: nothing of the trainer
    "streamrl.engine": ("streamrl.memory_use", "streamrl.models", "streamrl.weights"),
    # the trainer's side of the engines
    "streamrl.fleet": (
        "streamrl.config",
        "streamrl.engine.options",
        "streamrl.events",
        "streamrl.placement",
        "streamrl.process",
        "streamrl.weights",
    ),
    # the trainer side of the weight wire: the engines' client, the wire's shared parts, and
    # the config its factory chooses from
    "streamrl.publish": (
        "streamrl.config",
        "streamrl.fleet",
        "streamrl.process",
        "streamrl.weights",
    ),
    # agents: the engines' client, rewards, wire types; the process helper (agent processes
    # that die with the rollout process)
    "streamrl.agents": (
        "streamrl.fleet",
        "streamrl.process",
        "streamrl.rewards",
        "streamrl.types",
        "streamrl.utils",
    ),
    "streamrl.tasks": ("streamrl.rewards",),
    "streamrl.data": ("streamrl.queues.accounting", "streamrl.tasks", "streamrl.types"),
    # the learner backends behind one interface
    "streamrl.backends": (
        "streamrl.algorithms",
        "streamrl.config",
        "streamrl.models",
        "streamrl.process",
        "streamrl.schedules",
        "streamrl.types",
        "streamrl.weights",
    ),
    # the memory planner: arithmetic on model shapes (the torch-free parts of the Megatron
    # package), the model's config, the engines' placement
    "streamrl.planner": (
        "streamrl.backends.megatron.families",
        "streamrl.backends.megatron.memory",
        "streamrl.backends.megatron.shapes",
        "streamrl.models",
        "streamrl.placement",
    ),
    # the long-running actors
    "streamrl.actors": (
        "streamrl.agents",
        "streamrl.backends",
        "streamrl.checkpoint",
        "streamrl.config",
        "streamrl.data",
        "streamrl.fleet",
        "streamrl.logs",
        "streamrl.metrics",
        "streamrl.process",
        "streamrl.publish",
        "streamrl.queues",
        "streamrl.rewards",
        "streamrl.types",
        "streamrl.weights",
    ),
}
"""Package or module -> what it may import besides itself (a prefix allows its submodules).
A module not named here (mains, launch, bench, cli) may import anything below `launch` (see
`test_nothing_below_the_launcher_imports_it`)."""

LAUNCH_FREE = ("streamrl.actors", "streamrl.queues", "streamrl.engine", "streamrl.fleet")
LAUNCH_FREE += ("streamrl.weights", "streamrl.publish", "streamrl.backends", "streamrl.mains")


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    """Every module `path` imports (absolute names; `from a import b` counts `a.b` when `a.b`
    is a module of the package, else `a`)."""
    name = module_name(path)
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")
                base = base if is_package else base[:-1]
                base = base[: len(base) - node.level + 1]
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            found.add(module)
            for alias in node.names:
                if f"{module}.{alias.name}" in MODULES:
                    found.add(f"{module}.{alias.name}")
    return found


PATHS = sorted(PACKAGE.rglob("*.py"))
MODULES = {module_name(path) for path in PATHS}
GRAPH = {
    module_name(path): {target for target in imports_of(path) if target.split(".")[0] == "streamrl"}
    - {module_name(path)}
    for path in PATHS
}


def _is_within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def _rule_of(module: str) -> str | None:
    """The most specific ALLOWED key that covers `module`."""
    keys = [key for key in ALLOWED if _is_within(module, key)]
    return max(keys, key=len) if keys else None


def test_the_walk_sees_the_package():
    assert {"streamrl.queues.buffer", "streamrl.engine.app", "streamrl.mains.trainer"} <= MODULES
    assert "streamrl.types" in GRAPH["streamrl.queues.buffer"]


def test_there_is_no_import_circle():
    """Depth-first search over the module graph; a back edge is a circle."""
    state: dict[str, int] = {}  # 1 = on the stack, 2 = done
    circles: list[list[str]] = []

    def visit(module: str, stack: list[str]) -> None:
        state[module] = 1
        for target in sorted(GRAPH.get(module, ())):
            # `import streamrl.x.y` also runs the packages above it; they are not edges here.
            if target not in GRAPH:
                continue
            if state.get(target) == 1:
                circles.append([*stack[stack.index(target) :], target])
            elif target not in state:
                visit(target, [*stack, target])
        state[module] = 2

    for module in sorted(GRAPH):
        if module not in state:
            visit(module, [module])
    assert not circles, "import circles: " + "; ".join(" -> ".join(c) for c in circles)


@pytest.mark.parametrize("module", sorted(m for m in GRAPH if _rule_of(m)))
def test_every_module_imports_only_what_its_layer_allows(module):
    rule = _rule_of(module)
    allowed = (rule, *ALLOWED[rule])
    forbidden = sorted(
        target
        for target in GRAPH[module] - {"streamrl"}  # `import streamrl`: its version only
        if not any(_is_within(target, prefix) for prefix in allowed)
    )
    assert not forbidden, f"{module} ({rule} layer) imports {forbidden}"


@pytest.mark.parametrize("module", sorted(m for m in GRAPH if m.startswith(LAUNCH_FREE)))
def test_nothing_below_the_launcher_imports_it(module):
    assert not {t for t in GRAPH[module] if _is_within(t, "streamrl.launch")}


def test_only_the_ray_launcher_imports_ray():
    importers = sorted(
        module_name(path)
        for path in PATHS
        if any(t == "ray" or t.startswith("ray.") for t in imports_of(path))
    )
    assert importers == ["streamrl.launch.ray.hosts", "streamrl.launch.ray.spawner"]


def test_the_wire_types_import_nothing_of_streamrl():
    assert GRAPH["streamrl.types"] == set()
