"""docs/configuration.md, generated from the config Structs and their field docstrings.

    python -m streamrl.config.doc > docs/configuration.md

A test keeps the committed page equal to this output.
"""

from __future__ import annotations

import ast
import inspect
import types
import typing

import msgspec

from streamrl import config
from streamrl.config import loading

HEADER = """# Configuration

One TOML file describes a run; every top-level table below is a section.
Unknown keys, wrong types and out-of-range values stop `streamrl run` and
`streamrl check` before anything starts, naming the file and the dotted key.
Any key can be overridden on the command line: `--set rollout.batch_size=16`
(the value is read as TOML, else as a string).

This page is generated from `streamrl/config/sections.py` (`python -m streamrl.config.doc`).
"""


def field_docs(struct: type) -> dict[str, str]:
    """Attribute docstrings (a string right after a field) of a Struct class."""
    tree = ast.parse(inspect.getsource(struct))
    docs: dict[str, str] = {}
    body = tree.body[0].body
    for node, following in zip(body, [*body[1:], None], strict=True):
        is_field = isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
        is_doc = (
            isinstance(following, ast.Expr)
            and isinstance(following.value, ast.Constant)
            and isinstance(following.value.value, str)
        )
        if is_field and is_doc:
            docs[node.target.id] = " ".join(following.value.value.split())
    return docs


def _type_name(annotation: typing.Any) -> str:
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _type_name(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join(_type_name(arg) for arg in typing.get_args(annotation))
    if origin is typing.Literal:
        return " \\| ".join(f"`{value!r}`" for value in typing.get_args(annotation))
    if origin is list:
        return f"list[{_type_name(typing.get_args(annotation)[0])}]"
    if origin is dict:
        return "table"
    return getattr(annotation, "__name__", str(annotation))


def _default(struct: type, name: str) -> str:
    for field in msgspec.structs.fields(struct):
        if field.name == name:
            if field.default is not msgspec.NODEFAULT:
                value = field.default
            elif field.default_factory is not msgspec.NODEFAULT:
                value = field.default_factory()
            else:
                return "(required)"
            if isinstance(value, msgspec.Struct):
                return "(table)"
            return f"`{loading._toml_value(value)}`"
    return ""


def section_markdown(prefix: str, struct: type) -> list[str]:
    hints = typing.get_type_hints(struct, include_extras=True)
    docs = field_docs(struct)
    rows = [
        f"## `[{prefix}]`",
        "",
        "| key | type | default | meaning |",
        "| --- | --- | --- | --- |",
    ]
    nested = []
    for name in struct.__struct_fields__:
        annotation = hints[name]
        inner = (
            typing.get_args(annotation)[0] if typing.get_origin(annotation) is list else annotation
        )
        if isinstance(inner, type) and issubclass(inner, msgspec.Struct):
            nested.append((f"{prefix}.{name}", inner))
            if inner is not annotation:
                rows.append(f"| `{name}` | array of tables | `[]` | see `[[{prefix}.{name}]]` |")
            continue
        rows.append(
            f"| `{name}` | {_type_name(annotation)} | {_default(struct, name)} | {docs.get(name, '')} |"
        )
    out = [*rows, ""]
    for name, inner in nested:
        out += section_markdown(name, inner)
    return out


def render() -> str:
    lines = [HEADER]
    hints = typing.get_type_hints(config.RunConfig)
    for name in config.RunConfig.__struct_fields__:
        lines += section_markdown(name, hints[name])
    return "\n".join(lines).rstrip() + "\n"


if __name__ == "__main__":
    print(render(), end="")
