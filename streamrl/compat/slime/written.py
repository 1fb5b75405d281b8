"""The config `streamrl from-slime` writes, and what it prints: each key with the slime flags
it came from, and the flags not mapped, grouped by reason, with the notes.
"""

from __future__ import annotations

import json
import textwrap
from dataclasses import dataclass, field
from typing import Any

SECTIONS = (
    "model", "data", "rollout", "engine", "buffer", "algorithm", "learner", "weights",
    "cluster", "train", "eval", "logging",
)  # fmt: skip


@dataclass
class Conversion:
    """The config (as a raw TOML dict) and what became of every flag."""

    raw: dict[str, Any] = field(default_factory=lambda: {name: {} for name in SECTIONS})
    sources: dict[str, list[str]] = field(default_factory=dict)
    """Dotted key -> the slime flags (or facts) it came from."""
    not_mapped: list[tuple[str, str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def set(self, key: str, value: Any, source: str) -> None:
        node = self.raw
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
        self.sources.setdefault(key, []).append(source)

    def get(self, key: str, default: Any = None) -> Any:
        node: Any = self.raw
        for part in key.split("."):
            if not isinstance(node, dict) or part not in node:
                return default
            node = node[part]
        return node

    def skip(self, flag: str, values: list[str], reason: str) -> None:
        self.not_mapped.append((text_of(flag, values), reason))


def text_of(flag: str, values: list[str]) -> str:
    """A flag and its values as the command line gave them."""
    return " ".join([flag, *values]) if flag else " ".join(values)


def render(conversion: Conversion, *, source: str) -> str:
    """The config as TOML: what was not mapped and the notes as comments on top, each key
    with the flags it came from."""
    lines = [f"# Written by `streamrl from-slime` from {source}.", "#"]
    lines += ["# " + line for line in _unmapped_lines(conversion)]
    lines.append("")
    lines += _table(conversion, conversion.raw, "")
    return "\n".join(lines).rstrip() + "\n"


def _table(conversion: Conversion, data: dict[str, Any], prefix: str) -> list[str]:
    from streamrl.config.loading import _toml_value

    lines: list[str] = []
    scalars = {k: v for k, v in data.items() if not isinstance(v, dict) and not _tables(v)}
    if scalars and prefix:
        lines.append(f"[{prefix}]")
    for key, value in scalars.items():
        dotted = f"{prefix}.{key}" if prefix else key
        comment = "; ".join(conversion.sources.get(dotted, []))
        lines.append(f"{key} = {_toml_value(value)}" + (f"  # {comment}" if comment else ""))
    if scalars:
        lines.append("")
    for key, value in data.items():
        dotted = f"{prefix}.{key}" if prefix else key
        if isinstance(value, dict):
            lines += _table(conversion, value, dotted)
        elif _tables(value):
            comment = "; ".join(conversion.sources.get(dotted, []))
            for item in value:
                lines.append(f"[[{dotted}]]" + (f"  # {comment}" if comment else ""))
                lines += [
                    f"{k} = {_toml_value(v)}" for k, v in item.items() if not isinstance(v, dict)
                ]
                for sub, table_value in item.items():
                    if isinstance(table_value, dict):
                        lines.append(f"[{dotted}.{sub}]")
                        lines += [f"{k} = {_toml_value(v)}" for k, v in table_value.items()]
                lines.append("")
    return lines


def _tables(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(v, dict) for v in value)


def _unmapped_lines(conversion: Conversion) -> list[str]:
    """The flags not mapped, grouped by reason, then the notes (wrapped)."""
    by_reason: dict[str, list[str]] = {}
    for flag, reason in conversion.not_mapped:
        by_reason.setdefault(reason, []).append(flag)
    lines = [f"slime flags with no streamrl key ({len(conversion.not_mapped)}):"]
    for reason, flags in by_reason.items():
        text = f"{', '.join(flags)}: {reason}"
        lines += _wrap(text, "      ")
    if conversion.notes:
        lines.append("notes:")
        for note in conversion.notes:
            lines += _wrap(note, "    ")
    return lines


def _wrap(text: str, indent: str) -> list[str]:
    return textwrap.wrap(
        text, 92, initial_indent="  ", subsequent_indent=indent, break_on_hyphens=False
    )


def report(conversion: Conversion) -> str:
    """What `streamrl from-slime` prints: each key with its flags, then what was not mapped."""
    lines = ["mapped:"]
    for key, sources in conversion.sources.items():
        lines.append(f"  {key} = {json.dumps(conversion.get(key))}  <- {'; '.join(sources)}")
    return "\n".join(lines + _unmapped_lines(conversion))
