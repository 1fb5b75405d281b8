"""The README and docs/ say what the code does: what they name exists, what they show runs.

Each test reads every page (README.md and docs/*.md) and reports every stale place at
once, as `page:line: problem`:

- every ```toml block is a config that passes `streamrl check`'s validation (the config
  rules, then `streamrl.check.find_problems` without the model checks: the user code it
  names imports, its data files read). A block that shows only a few sections is marked
  as a fragment by the line `<!-- fragment -->` right above it; a fragment is checked
  merged over `BASE`. A block that is not a config takes another fence language;
- so do the shipped configs (`configs/`, `examples/`, `bench/configs/`);
- every `streamrl ...` command line (in a code block or inline) parses with the CLI's own
  parser; a synopsis (`[--opt]`, `A|B`, `...`) names only subcommands and options that exist;
- every repository path (`streamrl/...`, `configs/...`, `bench/...`, `tests/...`,
  `docs/...`, `examples/...`), every `.py` file in backticks (a short name such as
  `model.py` in one of the folders its page names), every `tests/x.py::test`, every link
  between pages (and its #heading) and every `streamrl.module:name` exists;
- every config key in backticks (`section.key`, `section.key = value`) is a field of the
  config tree, and a value shown with it is one the field accepts;
- docs/configuration.md is what `python -m streamrl.config.doc` writes, and the
  `generate_kwargs` tables of docs/agents.md list the option Structs' fields and defaults.

Everything runs in this process (no model is loaded, no subprocess is started): the
module takes a few seconds. Reading the pages is in tests/house/docs_pages.py.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import shlex
import tomllib
import typing
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
from docs_pages import (
    PAGES,
    REPO_FOLDERS,
    ROOT,
    anchors,
    code_spans,
    fenced_blocks,
    field_type,
    missing_test_problem,
    path_exists,
    prose_lines,
    python_name_problem,
    repository_paths,
)

from streamrl.config import ConfigError, RunConfig, load_config
from streamrl.config.loading import config_from_dict, dump_toml

SHIPPED_CONFIGS = sorted(
    [
        *ROOT.glob("configs/**/*.toml"),
        *ROOT.glob("examples/**/*.toml"),
        *ROOT.glob("bench/configs/*.toml"),
    ]
)

BASE = {"data": {"path": "builtin:arithmetic"}}
"""What a fragment is merged over: the one key a config cannot do without."""

OTHER_PROJECTS_FILES = {
    "clip_grads.py": "megatron-core's megatron/core/optimizer/clip_grads.py",
    "train.py": "slime's synchronous driver",
    "train_async.py": "slime's asynchronous driver",
}
"""Python files of other projects that the docs name by their bare name."""
OTHER_PROJECTS_FOLDERS = ("sglang/",)
"""A backticked path starting here is a file of that project."""
FILE_SUFFIXES = (".py", ".md", ".json", ".jsonl", ".toml", ".safetensors", ".msgpack", ".txt")


def report(problems: list[str]) -> str:
    return f"{len(problems)} stale place(s) in the docs:\n" + "\n".join(problems)


# ---------------------------------------------------------------- configs


def _merged(base: dict, over: dict) -> dict:
    out = dict(base)
    for key, value in over.items():
        both_tables = isinstance(value, dict) and isinstance(out.get(key), dict)
        out[key] = _merged(out[key], value) if both_tables else value
    return out


def check_problems(raw: dict, source: str) -> list[str]:
    """What `streamrl check` says about a config, without opening models."""
    from streamrl.check import find_problems

    try:
        cfg = config_from_dict(raw, source=source)
    except ConfigError as exc:
        return [str(exc)]
    return [f"{source}: {problem}" for problem in find_problems(cfg, models=False)]


TOML_BLOCKS = [block for page in PAGES for block in fenced_blocks(page) if block.lang == "toml"]


@pytest.mark.parametrize("block", TOML_BLOCKS, ids=[block.where for block in TOML_BLOCKS])
def test_every_toml_block_of_the_docs_passes_streamrl_check(block, monkeypatch):
    monkeypatch.chdir(ROOT)
    try:
        raw = tomllib.loads(block.text)
    except tomllib.TOMLDecodeError as exc:
        pytest.fail(f"{block.where}: not valid TOML: {exc}")
    if block.is_fragment:
        raw = _merged(BASE, raw)
    assert not (problems := check_problems(raw, block.where)), report(problems)


@pytest.mark.parametrize("path", SHIPPED_CONFIGS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_shipped_config_passes_streamrl_check(path, monkeypatch):
    monkeypatch.chdir(ROOT)  # data paths in shipped configs are relative to the repository
    raw = tomllib.loads(path.read_text())
    assert not (problems := check_problems(raw, str(path.relative_to(ROOT)))), report(problems)
    cfg = load_config(path)
    assert isinstance(cfg, RunConfig) and dump_toml(cfg)  # and it round-trips as written


# ---------------------------------------------------------------- commands


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _option_strings(parser: argparse.ArgumentParser) -> set[str]:
    return {option for action in parser._actions for option in action.option_strings}


COMMAND_LANGS = ("bash", "sh", "console")
"""Fences whose lines are shell commands; diagrams and output take ```text."""
PLACEHOLDER = re.compile(r"[A-Z][A-Z0-9_]*")
"""A word such as CONFIG, DIR or N: the command is a synopsis."""


def command_lines() -> Iterator[tuple[str, str]]:
    """(page:line, command) of every `streamrl` command line in code blocks and code spans."""
    for page in PAGES:
        for block in fenced_blocks(page):
            if block.lang not in COMMAND_LANGS:
                continue
            logical = block.text.replace("\\\n", " ").splitlines()
            for offset, line in enumerate(logical):
                words = line.split()
                while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]):
                    words = words[1:]  # environment assignments
                if words[:1] == ["streamrl"] or words[:3] == ["python", "-m", "streamrl"]:
                    yield f"{block.where.rsplit(':', 1)[0]}:{block.line + offset}", " ".join(words)
        for where, span in code_spans(page):
            if span == "streamrl" or span.startswith("streamrl "):
                yield where, span


def command_problem(parser: argparse.ArgumentParser, command: str) -> str | None:
    """Why `command` does not parse (None when it does)."""
    try:
        words = shlex.split(command, comments=True)
    except ValueError as exc:
        return f"cannot split {command!r}: {exc}"
    words = words[3:] if words[:1] == ["python"] else words[1:]
    node, rest = parser, list(words)
    while rest and (choices := _subcommands(node)):
        alternatives = rest[0].split("|")
        unknown = [name for name in alternatives if name not in choices]
        if rest[0].startswith("-"):
            break
        if unknown:
            return f"no command {' '.join(unknown)!r} (known: {', '.join(choices)})"
        if len(alternatives) > 1:  # `a|b ...`: a synopsis of several subcommands
            return None
        node, rest = choices[rest[0]], rest[1:]
    if not rest:
        return None  # the command named, not run
    for index, word in enumerate(rest[:-1]):
        if word == "--set" and (problem := override_problem(rest[index + 1])):
            return f"{command!r}: {problem}"
    is_synopsis = any(
        word == "..."
        or word.startswith("[")
        or "|" in word
        or word.endswith("]")
        or PLACEHOLDER.fullmatch(word)
        for word in rest
    )
    if is_synopsis:
        options = {w.strip("[]").split("=")[0] for w in rest if w.strip("[").startswith("--")}
        unknown = sorted(options - _option_strings(node))
        return f"no option(s) {unknown} in {command!r}" if unknown else None
    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors), contextlib.redirect_stdout(io.StringIO()):
            parser.parse_args(words)
    except SystemExit as exit_:
        if exit_.code:
            return f"{command!r}: {errors.getvalue().strip().splitlines()[-1]}"
    return None


def override_problem(item: str) -> str | None:
    """Why `--set key=value` names no config key or a value it refuses (None when fine)."""
    key, _, value = item.partition("=")
    return value_problem(key, value) if "=" in item and "." in key else None


def test_every_code_block_says_what_it_holds():
    unlabeled = [block.where for page in PAGES for block in fenced_blocks(page) if not block.lang]
    assert not unlabeled, report(
        [f"{where}: a ``` block without a language" for where in unlabeled]
    )


def test_every_streamrl_command_line_in_the_docs_parses():
    from streamrl.cli import build_parser

    parser = build_parser()
    found = list(command_lines())
    problems = [
        f"{where}: {problem}"
        for where, command in found
        if (problem := command_problem(parser, command))
    ]
    assert not problems, report(problems)
    assert len(found) > 50  # the extraction itself still finds the commands


# ---------------------------------------------------------------- paths and names


def page_folders(page: Path) -> set[Path]:
    """Where a page's short file names (`model.py`, `queues/intake.py`) are looked up: the
    repository, `streamrl/`, and every folder the page names or names a file of."""
    folders = {ROOT, ROOT / "streamrl"}
    for _, path in repository_paths(page):
        named = ROOT / path
        folders.add(named if named.is_dir() else named.parent)
    for _, span in code_spans(page):
        if span.endswith("/"):
            folders.update(f / span for f in (ROOT, ROOT / "streamrl") if (f / span).is_dir())
    return folders


def _python_file_problem(span: str, folders: set[Path]) -> str | None:
    """A backticked `x.py` or `a/b.py` names a file in one of the page's folders (or of a
    project the docs name it for)."""
    if span in OTHER_PROJECTS_FILES or span.startswith(OTHER_PROJECTS_FOLDERS):
        return None
    if any((folder / span).is_file() for folder in folders):
        return None
    return f"no file {span} in the folders this page names"


def test_every_file_module_and_test_named_in_the_docs_exists():
    problems = []
    for page in PAGES:
        name = page.relative_to(ROOT)
        for number, path in repository_paths(page):
            if not path_exists(path):
                problems.append(f"{name}:{number}: no such path {path}")
    spans = {(page, where, span) for page in PAGES for where, span in code_spans(page)}
    folders = {page: page_folders(page) for page in PAGES}
    for page, where, span in spans:
        if "::" in span and span.startswith("tests/"):
            problem = missing_test_problem(span)
        elif re.fullmatch(r"[\w./-]*\w\.py", span) and span.split("/")[0] not in REPO_FOLDERS:
            problem = _python_file_problem(span, folders[page])  # a short name
        elif re.fullmatch(r"streamrl(\.\w+)+(:\w+)?", span):
            problem = python_name_problem(span)
        else:
            continue
        if problem:
            problems.append(f"{where}: {problem}")
    assert not problems, report(sorted(problems))


def test_every_link_between_pages_leads_to_a_file_and_heading():
    problems = []
    for page in PAGES:
        for number, line in prose_lines(page):
            for target in re.findall(r"\]\(([^)\s]+)\)", line):
                if re.match(r"[a-z]+:", target):
                    continue  # http:, mailto:
                file, _, anchor = target.partition("#")
                linked = (page.parent / file).resolve() if file else page
                where = f"{page.relative_to(ROOT)}:{number}"
                if not linked.exists():
                    problems.append(f"{where}: no such file {target}")
                elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
                    problems.append(f"{where}: {file or page.name} has no heading #{anchor}")
    assert not problems, report(problems)


# ---------------------------------------------------------------- config keys


def config_key_mentions() -> Iterator[tuple[str, str, str | None]]:
    """(page:line, dotted key, value text or None) for each backticked config key."""
    sections = set(RunConfig.__struct_fields__)
    pattern = re.compile(r"([a-z_]+(?:\.[a-z_0-9]+|\[\d+\])+)(?:\s*=\s*(.+))?")
    for page in PAGES:
        for where, span in code_spans(page):
            match = pattern.fullmatch(span.strip())
            if not match or match.group(1).endswith(FILE_SUFFIXES):
                continue
            if match.group(1).split(".")[0].split("[")[0] in sections:
                yield where, match.group(1), match.group(2)


def value_problem(key: str, value: str | None) -> str | None:
    """Why `key` is no config key, or `value` (TOML text) not one it takes."""
    annotation = field_type(key)
    if annotation is None:
        return f"no config key {key}"
    if value is None or annotation is typing.Any:
        return None
    try:
        parsed = tomllib.loads(f"v = {value}")["v"]
    except tomllib.TOMLDecodeError:
        return None  # a placeholder (`train.steps = N`) or a bare string after --set
    try:
        msgspec.convert(parsed, annotation)
    except msgspec.ValidationError as exc:
        return f"{key} = {value}: {exc}"
    return None


def test_every_config_key_named_in_the_docs_exists_and_takes_the_value_shown():
    mentions = list(config_key_mentions())
    problems = [
        f"{where}: {problem}"
        for where, key, value in mentions
        if (problem := value_problem(key, value))
    ]
    assert not problems, report(problems)
    assert len(mentions) > 200  # the extraction itself still finds the keys


# ---------------------------------------------------------------- generated and tabled


def test_the_configuration_page_is_generated_from_the_code():
    from streamrl.config.doc import render

    page = (ROOT / "docs" / "configuration.md").read_text()
    assert page == render(), "run: python -m streamrl.config.doc > docs/configuration.md"


def options_table(page: Path, heading: str) -> dict[str, str]:
    """key -> default text of the table under `heading` (`| key | default | meaning |`)."""
    lines = page.read_text().splitlines()
    start = lines.index(heading)
    rows: dict[str, str] = {}
    for line in lines[start + 1 :]:
        if line.startswith("#"):
            break
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if not line.startswith("| `") or len(cells) < 3:
            continue
        keys = re.findall(r"`(\w+)`", cells[0])
        defaults = [d.strip().strip("`") for d in cells[1].split(",")] if cells[1] else []
        for index, key in enumerate(keys):
            rows[key] = defaults[index] if index < len(defaults) else ""
    return rows


@pytest.mark.parametrize(
    ("heading", "options"),
    [
        (
            "### Options (`rollout.generate_kwargs` of `streamrl.agents.env:generate`)",
            "streamrl.agents.env:EnvOptions",
        ),
        (
            "### Options (`rollout.generate_kwargs` of `streamrl.agents.gateway:generate`)",
            "streamrl.agents.gateway.episode:AgentOptions",
        ),
        (
            "### Options (`rollout.generate_kwargs` of `streamrl.compat.slime:generate`)",
            "streamrl.compat.slime.generate:SlimeOptions",
        ),
    ],
)
def test_the_generate_kwargs_tables_list_every_option_with_its_default(heading, options):
    from streamrl.utils import import_object

    struct = import_object(options, "options")
    (page,) = [page for page in PAGES if heading in page.read_text().splitlines()]
    table = options_table(page, heading)
    fields = {field.name: field for field in msgspec.structs.fields(struct)}
    assert sorted(table) == sorted(fields), f"{heading}: the table and {options} differ"
    for key, text in table.items():
        field = fields[key]
        if field.required:
            assert text == "required", f"{key}: {text!r}, but it is required"
            continue
        default = field.default_factory() if field.default is msgspec.NODEFAULT else field.default
        if text:  # a blank cell gives no default
            assert tomllib.loads(f"v = {text}")["v"] == default, f"{key}: {text} != {default!r}"


def test_every_docs_page_is_in_the_readmes_table():
    readme = (ROOT / "README.md").read_text()
    missing = [
        str(page.relative_to(ROOT))
        for page in PAGES[1:]
        if f"| [{page.relative_to(ROOT)}]({page.relative_to(ROOT)}) |" not in readme
    ]
    assert not missing, f"README.md's documentation table lacks {missing}"
