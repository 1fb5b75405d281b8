"""Small helpers shared by several components."""

from __future__ import annotations

import importlib
from typing import Any


def import_object(spec: str, what: str) -> Any:
    """Resolve `package.module:attr` (or `module:attr.sub`) to the object it names.

    `what` is the config key the spec came from (e.g. `rollout.reward_fn`); it
    leads every error message, which also gives the spec and the reason.
    """
    module_name, sep, attr_path = spec.partition(":")
    if not sep or not module_name or not attr_path:
        raise ValueError(f"{what}: {spec!r} is not of the form 'package.module:attribute'")
    try:
        obj: Any = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise ValueError(f"{what}: {spec!r}: module not found ({exc})") from None
    except Exception as exc:  # the module exists but importing it failed
        raise ValueError(
            f"{what}: {spec!r}: importing {module_name} failed: {type(exc).__name__}: {exc}"
        ) from exc
    resolved = module_name
    for part in attr_path.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{what}: {spec!r}: {resolved} has no attribute {part!r}")
        obj = getattr(obj, part)
        resolved = f"{resolved}.{part}"
    return obj
