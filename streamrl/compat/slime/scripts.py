"""A slime launch script read as far as `streamrl from-slime` needs: its arrays and variables
(`MODEL_ARGS=( ... )`, `NAME=value`), the model script it sources, and the `train.py` /
`train_async.py` command line with `${ARRAY[@]}` and `$VAR` expanded.

Not a shell: statements are split on lines (a backslash joins lines; quotes and `( ... )`
arrays may span them), words by shlex. What cannot be expanded (an array no file given
defines, `$(...)`) is kept in `unexpanded` and reported.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

DRIVERS = ("train.py", "train_async.py")
_ARRAY_START = re.compile(r"^(\w+)(\+?)=\((.*)$", re.S)
_ASSIGN = re.compile(r"^(\w+)=(.*)$", re.S)
_ARRAY_REF = re.compile(r"^\$\{(\w+)\[@\]\}$")
_VAR_REF = re.compile(r"\$\{(\w+)\}|\$(\w+)")


@dataclass
class SlimeCommand:
    """The slime command line found in the inputs."""

    driver: str = ""
    """train.py or train_async.py ("" when no command line was found)."""
    words: list[str] = field(default_factory=list)
    """Everything after the driver, expanded."""
    model_script: str = ""
    """The stem of a sourced `scripts/models/<name>.sh` (e.g. "qwen3-4B")."""
    unexpanded: list[str] = field(default_factory=list)
    unread: list[str] = field(default_factory=list)
    """Sourced files that could not be read."""


@dataclass
class _Shell:
    arrays: dict[str, list[str]] = field(default_factory=dict)
    variables: dict[str, str] = field(default_factory=dict)
    command: SlimeCommand = field(default_factory=SlimeCommand)


def read_command(scripts: list[str | Path], argv: list[str] = ()) -> SlimeCommand:
    """Read `scripts` in order (their arrays and variables are shared), then take the command
    line from `argv` when given, else from the last script line that runs a driver."""
    shell = _Shell()
    for script in scripts:
        _read_file(shell, Path(script))
    if argv:
        _command(shell, list(argv), explicit=True)
    return shell.command


def _read_file(shell: _Shell, path: Path) -> None:
    for words in _statements(path.read_text()):
        _statement(shell, words, path.parent)


def _statements(text: str) -> list[list[str]]:
    """Shell words per statement: lines joined while quotes or an array are open."""
    text = text.replace("\\\n", " ")
    out, pending = [], ""
    for line in text.splitlines():
        pending = f"{pending}\n{line}" if pending else line
        try:
            words = shlex.split(pending, comments=True, posix=True)
        except ValueError:  # an open quote: the statement goes on
            continue
        if words and _ARRAY_START.match(words[0]) and not _closes_array(words):
            continue
        pending = ""
        if words:
            out.append(words)
    return out


def _closes_array(words: list[str]) -> bool:
    first = _ARRAY_START.match(words[0]).group(3)
    rest = [first, *words[1:]] if first else words[1:]
    return bool(rest) and rest[-1].endswith(")")


def _statement(shell: _Shell, words: list[str], here: Path) -> None:
    if words[0] == "export":
        words = words[1:]
        if not words:
            return
    array = _ARRAY_START.match(words[0])
    if array:
        name, append, first = array.groups()
        items = ([first] if first else []) + words[1:]
        items[-1] = items[-1][:-1]  # the closing parenthesis
        items = [item for item in items if item]
        expanded = _expand(shell, items)
        shell.arrays[name] = (shell.arrays.get(name, []) if append else []) + expanded
        return
    if words[0] in ("source", ".") and len(words) > 1:
        _source(shell, _substitute(shell, words[1]), here)
        return
    if any(word.endswith(DRIVERS) for word in words):
        _command(shell, words, explicit=False)
        return
    if len(words) == 1 and (assign := _ASSIGN.match(words[0])):
        shell.variables[assign.group(1)] = _substitute(shell, assign.group(2))


def _source(shell: _Shell, name: str, here: Path) -> None:
    stem = Path(name).stem
    if Path(name).parent.name == "models":
        shell.command.model_script = stem
    for candidate in (Path(name), here / name):
        if candidate.is_file():
            _read_file(shell, candidate)
            return
    shell.command.unread.append(name)


def _command(shell: _Shell, words: list[str], *, explicit: bool) -> None:
    """The words after the driver (`python train.py ...`, `ray job submit ... -- python3
    train_async.py ...`); with `explicit`, words without a driver are all flags."""
    position = next((i for i, word in enumerate(words) if word.endswith(DRIVERS)), None)
    if position is None:
        if not explicit:
            return
        driver, rest = "", words
    else:
        driver, rest = Path(words[position]).name, words[position + 1 :]
    shell.command.driver = driver or shell.command.driver
    shell.command.words = _expand(shell, rest)


def _expand(shell: _Shell, words: list[str]) -> list[str]:
    out: list[str] = []
    for word in words:
        reference = _ARRAY_REF.match(word)
        if reference:
            name = reference.group(1)
            if name in shell.arrays:
                out.extend(shell.arrays[name])
            else:
                shell.command.unexpanded.append(word)
            continue
        out.append(_substitute(shell, word))
    return out


def _substitute(shell: _Shell, word: str) -> str:
    """`$VAR` / `${VAR}` replaced where the scripts set VAR; others kept (and reported)."""

    def value(match: re.Match) -> str:
        name = match.group(1) or match.group(2)
        if name in shell.variables:
            return shell.variables[name]
        if match.group(0) not in shell.command.unexpanded:
            shell.command.unexpanded.append(match.group(0))
        return match.group(0)

    return _VAR_REF.sub(value, word)


def split_flags(words: list[str]) -> list[tuple[str, list[str]]]:
    """`--flag v1 v2 --switch ...` -> [("--flag", ["v1", "v2"]), ("--switch", [])]; a word
    before the first flag is kept under the flag "" (reported as not mapped)."""
    flags: list[tuple[str, list[str]]] = []
    for word in words:
        if word.startswith("--") and len(word) > 2:
            name, equals, value = word.partition("=")
            flags.append((name, [value] if equals else []))
        elif flags:
            flags[-1][1].append(word)
        else:
            flags.append(("", [word]))
    return flags
