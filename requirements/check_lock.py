"""Compare the running environment with the lock files: exit 1 on any difference.

    python requirements/check_lock.py [LOCK ...]

Prints one line per package that is missing, at another version, or installed but not
locked (pip itself and streamrl are not in the lock). `make setup` runs it last, so an
environment that `make` built holds exactly the locked versions or says why not.
"""

from __future__ import annotations

import re
import sys
from importlib import metadata
from pathlib import Path

DEFAULT_LOCKS = ("requirements/lock-cpu.txt", "requirements/lock-smollm2.txt")
UNLOCKED = {"pip", "streamrl"}
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;\\]+)")


def normalize(name: str) -> str:
    """PEP 503's normal form: lower case, runs of `-_.` as one `-`."""
    return re.sub(r"[-_.]+", "-", name).lower()


def locked_versions(paths: list[str]) -> dict[str, str]:
    versions: dict[str, str] = {}
    for path in paths:
        for line in Path(path).read_text().splitlines():
            if match := PIN.match(line):
                versions[normalize(match[1])] = match[2]
    return versions


def installed_versions() -> dict[str, str]:
    return {normalize(d.metadata["Name"]): d.version for d in metadata.distributions()}


def differences(locked: dict[str, str], installed: dict[str, str]) -> list[str]:
    lines = []
    for name in sorted(locked.keys() | installed.keys()):
        want, have = locked.get(name), installed.get(name)
        if name in UNLOCKED or want == have:
            continue
        if have is None:
            lines.append(f"missing   {name}=={want}")
        elif want is None:
            lines.append(f"unlocked  {name}=={have}")
        else:
            lines.append(f"version   {name}: locked {want}, installed {have}")
    return lines


def main(argv: list[str]) -> int:
    paths = argv or list(DEFAULT_LOCKS)
    found = differences(locked_versions(paths), installed_versions())
    for line in found:
        print(line)
    print(f"environment {'differs from' if found else 'matches'} {', '.join(paths)}")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
