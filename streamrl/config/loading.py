"""Reading a run's config: TOML, `--set a.b=c` overrides, validation errors that name the
file and the dotted key, and the resolved config written back as TOML."""

from __future__ import annotations

import re
import tomllib
import typing
from pathlib import Path
from typing import Any

import msgspec

from streamrl.config.run import RunConfig
from streamrl.config.sections import ConfigError


def load_config(path: str | Path, overrides: list[str] = ()) -> RunConfig:
    """Read a TOML file, apply `section.key=value` overrides and validate.

    Raises ConfigError naming the file and the dotted key of the first problem.
    """
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    for item in overrides:
        apply_override(raw, item)
    return config_from_dict(raw, source=str(path))


def config_from_dict(raw: dict[str, Any], source: str = "<dict>") -> RunConfig:
    """Validate a plain dict (as parsed from TOML) into a RunConfig."""
    try:
        return msgspec.convert(raw, RunConfig)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"{source}: {_describe(exc)}") from None


def apply_override(raw: dict[str, Any], item: str) -> None:
    """Set `a.b.c=value` in a raw config dict; value is parsed as TOML, else kept as a string."""
    key, sep, text = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"--set {item!r}: expected section.key=value")
    try:
        value = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        value = text
    node = raw
    *parents, leaf = key.split(".")
    for part in parents:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"--set {key}: {part!r} is not a table")
        node = child
    node[leaf] = value


def _describe(exc: msgspec.ValidationError) -> str:
    """Turn msgspec's '... - at `$.a.b`' into 'a.b: ...' with the expected type spelled out."""
    message = str(exc)
    text, _, where = message.rpartition(" - at `")
    if not text:
        text, where = message, "$`"
    dotted = where.rstrip("`").removeprefix("$").lstrip(".")
    if text.startswith("Object contains unknown field"):
        field = text.split("`")[1]
        dotted = f"{dotted}.{field}" if dotted else field
        section = _section_type(dotted.rsplit(".", 1)[0]) if "." in dotted else RunConfig
        known = ", ".join(section.__struct_fields__) if section else ""
        return f"{dotted}: unknown key (known keys here: {known})"
    return f"{dotted or '<top level>'}: {text}"


def _section_type(dotted: str) -> type | None:
    """The Struct type found at a dotted path of RunConfig (list items unwrapped)."""
    node: Any = RunConfig
    for part in re.sub(r"\[\d+\]", "", dotted).split("."):
        annotation = typing.get_type_hints(node).get(part)
        if typing.get_origin(annotation) is list:
            annotation = typing.get_args(annotation)[0]
        if not (isinstance(annotation, type) and issubclass(annotation, msgspec.Struct)):
            return None
        node = annotation
    return node


def to_toml_dict(cfg: msgspec.Struct) -> dict[str, Any]:
    """The resolved config as plain builtins (for `streamrl check` and the run dir)."""
    return msgspec.to_builtins(cfg)


def dump_toml(cfg: RunConfig) -> str:
    """Render a resolved config as TOML (written into the run dir, printed by `check`)."""
    return _render_toml(to_toml_dict(cfg))


def _render_toml(data: dict[str, Any], prefix: str = "") -> str:
    scalars = {k: v for k, v in data.items() if not _is_table(v)}
    lines = [f"{k} = {_toml_value(v)}" for k, v in scalars.items()]
    out = []
    if lines:
        if prefix:
            out.append(f"[{prefix}]")
        out.extend(lines)
        out.append("")
    for key, value in data.items():
        name = f"{prefix}.{key}" if prefix else key
        if isinstance(value, dict):
            out.append(_render_toml(value, name))
        elif _is_table(value):
            for item in value:
                out.append(f"[[{name}]]")
                out.extend(f"{k} = {_toml_value(v)}" for k, v in item.items() if not _is_table(v))
                out.append("")
                for key2, sub in item.items():
                    if isinstance(sub, dict):
                        out.append(_render_toml(sub, f"{name}.{key2}"))
    return "\n".join(out)


def _is_table(value: Any) -> bool:
    if isinstance(value, dict):
        return True
    return isinstance(value, list) and bool(value) and all(isinstance(v, dict) for v in value)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return msgspec.json.encode(value).decode()
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {_toml_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"cannot render {value!r} as TOML")
