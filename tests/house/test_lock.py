"""The lock files: they cover pyproject's ranges, the GPU pins agree with them, and
`requirements/check_lock.py` reports every way an environment can differ from them."""

from __future__ import annotations

import importlib.util
import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]
LOCKS = [str(ROOT / "requirements" / name) for name in ("lock-cpu.txt", "lock-smollm2.txt")]


def _check_lock():
    spec = importlib.util.spec_from_file_location("check_lock", ROOT / "requirements/check_lock.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _requirements() -> list[Requirement]:
    """pyproject's dependencies and the test extra, with the extras it names expanded."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    found, pending = [], [*project["dependencies"], *extras["test"]]
    while pending:
        requirement = Requirement(pending.pop())
        if requirement.name == "streamrl":
            pending.extend(line for extra in requirement.extras for line in extras[extra])
        else:
            found.append(requirement)
    return found


def test_every_dependency_is_locked_at_a_version_its_range_allows():
    check = _check_lock()
    locked = check.locked_versions(LOCKS)
    problems = []
    for requirement in _requirements():
        version = locked.get(check.normalize(requirement.name))
        if version is None or not requirement.specifier.contains(version, prereleases=True):
            problems.append(f"{requirement} locked at {version}")
    assert not problems, f"run `make lock`: {problems}"


def test_the_gpu_machines_carried_wheels_are_pinned_at_the_locked_versions():
    check = _check_lock()
    locked = check.locked_versions(LOCKS)
    gpu = check.locked_versions([str(ROOT / "requirements" / "gpu.txt")])
    carried = {"megatron-core", "msgspec", "pyzmq", "gguf", "math-verify"}
    assert set(gpu) == carried | {"latex2sympy2-extended", "antlr4-python3-runtime"}
    assert {name: locked[name] for name in gpu} == gpu


def test_the_lock_check_names_missing_unlocked_and_other_versions():
    check = _check_lock()
    locked = {"torch": "2.13.0+cpu", "msgspec": "0.23.0", "typing-extensions": "4.16.0"}
    installed = {"torch": "2.13.0+cpu", "msgspec": "0.22.0", "requests": "2.0", "pip": "24.0"}
    assert check.differences(locked, installed) == [
        "version   msgspec: locked 0.23.0, installed 0.22.0",
        "unlocked  requests==2.0",
        "missing   typing-extensions==4.16.0",
    ]
    assert check.differences(locked, locked) == []
    assert check.normalize("Typing_Extensions") == check.normalize("typing.extensions")


def test_the_lock_pins_every_package_with_a_hash():
    for path in LOCKS:
        entries = re.split(r"\n(?=\S)", Path(path).read_text())
        pins = [e for e in entries if re.match(r"[A-Za-z0-9]", e)]
        assert pins and all("==" in e and "--hash=sha256:" in e for e in pins), path
