"""Prompt data as rows: JSONL, Parquet and `builtin:` tasks, each record checked.

`checked_rows` is the one parser and validator: `PromptSource` (`streamrl.data.source`)
loads through it and `streamrl check` scans with it (`scan_rows`). A record is a JSON
object with the prompt under `input_key` (a string, or a list of chat messages when
the chat template is on), an optional label and an optional metadata object. Errors
are `DataError`s whose message starts with `path:line:`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

import msgspec


class DataError(ValueError):
    """Unusable prompt data; the message starts with `path:line:` where a line is at fault."""


class Row(msgspec.Struct, frozen=True, gc=False):
    """One valid record: the prompt (text or chat messages), its label and metadata."""

    value: str | list[dict[str, str]]
    label: Any
    metadata: dict[str, Any]


def _check_row(
    obj: Any, *, input_key: str, label_key: str, metadata_key: str, allow_messages: bool
) -> Row:
    """Validate one decoded row; raises DataError with a message (no location)."""
    if not isinstance(obj, dict):
        raise DataError(f"expected a JSON object, got {type(obj).__name__}")
    if input_key not in obj:
        raise DataError(f"missing input key {input_key!r} (keys: {sorted(obj)})")
    value = obj[input_key]
    if isinstance(value, list):
        if not allow_messages:
            raise DataError(
                f"{input_key!r} is a list of chat messages but data.apply_chat_template = false"
            )
        if not value:
            raise DataError(f"{input_key!r} is an empty message list")
        for i, message in enumerate(value):
            if not (
                isinstance(message, dict)
                and isinstance(message.get("role"), str)
                and isinstance(message.get("content"), str)
            ):
                raise DataError(
                    f"{input_key}[{i}] must be an object with string 'role' and 'content', "
                    f"got {message!r:.80}"
                )
    elif not isinstance(value, str):
        raise DataError(
            f"{input_key!r} must be a string or a list of chat messages, got {type(value).__name__}"
        )
    metadata = obj.get(metadata_key)
    if metadata is None:
        metadata = {}
    elif not isinstance(metadata, dict):
        raise DataError(f"{metadata_key!r} must be an object, got {type(metadata).__name__}")
    return Row(value=value, label=obj.get(label_key), metadata=metadata)


def checked_rows(
    path: str,
    *,
    input_key: str = "prompt",
    label_key: str = "label",
    metadata_key: str = "metadata",
    allow_messages: bool = True,
) -> Iterator[tuple[int, Row | DataError]]:
    """(line number, row or its error) for every non-blank record of `path`, in file order.

    The one parser and validator of prompt data: `PromptSource` loads through it and
    `streamrl check` scans with it. An error's message starts with `path:line:`; a file
    that cannot be opened raises DataError instead. Built-in tasks use their own keys.
    """
    if path.startswith("builtin:"):
        input_key, label_key, metadata_key = "prompt", "label", "metadata"
    for number, record in records(path):
        if isinstance(record, DataError):
            yield number, DataError(f"{path}:{number}: {record}")
            continue
        try:
            row = _check_row(
                record,
                input_key=input_key,
                label_key=label_key,
                metadata_key=metadata_key,
                allow_messages=allow_messages,
            )
        except DataError as exc:
            yield number, DataError(f"{path}:{number}: {exc}")
            continue
        yield number, row


class DataScan(msgspec.Struct, kw_only=True):
    """What `scan_rows` found in the first `max_rows` records of a data file."""

    num_rows: int = 0
    """Records read (blank lines are not records)."""
    num_bad: int = 0
    """Records that `PromptSource` would refuse (or skip with `data.on_bad_line = "skip"`)."""
    first_error: str = ""
    """The first bad record's error, `path:line: ...`; empty when none was bad."""
    is_complete: bool = True
    """False when the file has records past `max_rows`, which were not read."""


def scan_rows(path: str, *, max_rows: int, **keys: Any) -> DataScan:
    """Read and validate up to `max_rows` records of `path` as `PromptSource` would
    (`keys`: those of `checked_rows`), counting the bad ones."""
    scan = DataScan()
    for _, row in checked_rows(path, **keys):
        if scan.num_rows == max_rows:
            scan.is_complete = False
            break
        scan.num_rows += 1
        if isinstance(row, DataError):
            scan.num_bad += 1
            scan.first_error = scan.first_error or str(row)
    return scan


def records(path: str, default_seed: int = 0) -> Iterable[tuple[int, Any | Exception]]:
    """(line number, decoded object or the decode error) for every non-blank record."""
    if path.startswith("builtin:"):
        from streamrl import tasks

        name, _, query = path.removeprefix("builtin:").partition("?")
        try:
            params = {k: v[-1] for k, v in parse_qs(query, strict_parsing=bool(query)).items()}
            unknown = set(params) - {"n", "seed"}
            if unknown:
                raise ValueError(f"unknown parameter(s) {sorted(unknown)}; known: n, seed")
            task = tasks.get_task(name)
            num_rows = int(params.get("n", task.default_num_rows))
            seed = int(params.get("seed", default_seed))
        except (KeyError, ValueError) as exc:
            raise DataError(f"{path}: {exc.args[0] if exc.args else exc}") from None
        return enumerate(task.rows(seed, num_rows), start=1)
    file = Path(path)
    if not file.is_file():
        raise DataError(f"{path}: no such file")
    if file.suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            rows = pq.read_table(file).to_pylist()
        except Exception as exc:
            raise DataError(f"{path}: not a readable Parquet file: {exc}") from None
        return enumerate(rows, start=1)
    return _jsonl_records(file)


def _jsonl_records(file: Path) -> Iterable[tuple[int, Any | Exception]]:
    decoder = msgspec.json.Decoder()
    with file.open("rb") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                yield number, decoder.decode(line)
            except msgspec.DecodeError as exc:
                yield number, DataError(f"malformed JSON: {exc}")
