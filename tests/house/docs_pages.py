"""Reading the README and docs/ for tests/house/test_docs.py: fenced blocks, code spans, the
repository paths a page names, and what a dotted name or config key resolves to (by the
files and the config Structs; no module is imported)."""

from __future__ import annotations

import ast
import re
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import msgspec

from streamrl.config import RunConfig

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FRAGMENT_MARKER = "<!-- fragment -->"
"""The line right above a ```toml block that shows only part of a config."""
REPO_FOLDERS = ("streamrl", "configs", "bench", "tests", "docs", "examples")
"""Top-level folders whose paths the docs name and the tests look up."""
FENCE = re.compile(r"(\s*)```(\w*)\s*")
"""A line that opens or closes a fenced block."""


@dataclass(frozen=True)
class Block:
    """A fenced code block of a page."""

    page: Path
    line: int
    """Line of its first content line."""
    lang: str
    text: str
    is_fragment: bool

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def fenced_blocks(page: Path) -> list[Block]:
    lines = page.read_text().splitlines()
    blocks = []
    index = 0
    while index < len(lines):
        opening = FENCE.fullmatch(lines[index])
        if not opening:
            index += 1
            continue
        indent, lang = opening.groups()
        previous = lines[index - 1].strip() if index else ""
        end = index + 1
        while end < len(lines) and lines[end].strip() != "```":
            end += 1
        body = [line.removeprefix(indent) for line in lines[index + 1 : end]]
        blocks.append(
            Block(page, index + 2, lang, "\n".join(body) + "\n", previous == FRAGMENT_MARKER)
        )
        index = end + 1
    return blocks


def prose_lines(page: Path) -> Iterator[tuple[int, str]]:
    """(line number, text) of every line outside fenced blocks."""
    inside = False
    for number, line in enumerate(page.read_text().splitlines(), start=1):
        if FENCE.fullmatch(line):
            inside = not inside
            continue
        if not inside:
            yield number, line


def code_spans(page: Path) -> Iterator[tuple[str, str]]:
    """(page:line, text) of every inline `code` span outside fenced blocks."""
    for number, line in prose_lines(page):
        for match in re.finditer(r"`([^`]+)`", line):
            yield f"{page.relative_to(ROOT)}:{number}", match.group(1).replace("\\|", "|")


def path_exists(path: str) -> bool:
    if any(mark in path for mark in "*<>"):
        return any(ROOT.glob(re.sub(r"<[^>]*>", "*", path)))
    return (ROOT / path).exists()


def repository_paths(page: Path) -> Iterator[tuple[int, str]]:
    folders = "|".join(REPO_FOLDERS)
    pattern = re.compile(rf"(?<![\w./-])(?:{folders})/[\w./*<>-]*")
    for number, line in enumerate(page.read_text().splitlines(), start=1):
        for match in pattern.finditer(line):
            path = match.group(0).split("::")[0].rstrip(".")
            yield number, path


def missing_test_problem(reference: str) -> str | None:
    file, _, name = reference.partition("::")
    path = ROOT / file
    if not path.is_file():
        return f"no file {file}"
    tree = ast.parse(path.read_text())
    defined = {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}
    return None if name in defined else f"{file} has no test {name}"


def _top_level_names(path: Path) -> dict[str, ast.AST]:
    names: dict[str, ast.AST] = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names[node.name] = node
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update({t.id: node for t in targets if isinstance(t, ast.Name)})
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update({(a.asname or a.name).split(".")[0]: node for a in node.names})
    return names


def _module_file(dotted: str) -> Path | None:
    base = ROOT.joinpath(*dotted.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def python_name_problem(name: str) -> str | None:
    """`streamrl.a.b`, `streamrl.a.b:attr` or `streamrl.a.b.attr[.member]` exists."""
    module, _, attribute = name.partition(":")
    parts = module.split(".")
    for cut in range(len(parts), 0, -1):
        path = _module_file(".".join(parts[:cut]))
        if path is not None:
            break
    else:
        return f"no module {module}"
    rest = parts[cut:] + ([attribute] if attribute else [])
    if not rest:
        return None
    names = _top_level_names(path)
    if rest[0] not in names:
        return f"{'.'.join(parts[:cut])} defines no {rest[0]}"
    node = names[rest[0]]
    if len(rest) > 1 and isinstance(node, ast.ClassDef):
        members = {
            getattr(n, "name", None) or getattr(getattr(n, "target", None), "id", None)
            for n in node.body
        }
        if rest[1] not in members:
            return f"{rest[0]} has no member {rest[1]}"
    return None


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    return {slug(line.lstrip("#")) for _, line in prose_lines(page) if re.match(r"#{1,6} ", line)}


def field_type(dotted: str) -> typing.Any | None:
    """The annotation of a dotted config key; `typing.Any` inside a free table; None when
    the config tree has no such key."""
    node: typing.Any = RunConfig
    for part in re.sub(r"\[\d+\]", "", dotted).split("."):
        if not (isinstance(node, type) and issubclass(node, msgspec.Struct)):
            return typing.Any  # a key inside a table such as rollout.generate_kwargs
        annotation = typing.get_type_hints(node, include_extras=True).get(part)
        if annotation is None:
            return None
        node = annotation
        while typing.get_origin(node) in (typing.Annotated, list):
            node = typing.get_args(node)[0]
        if typing.get_origin(node) is dict:
            node = dict
    return annotation
