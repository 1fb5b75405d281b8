"""Logging of every streamrl process, with repeated warnings written once and then counted.

    13:02:11 WARNING streamrl.actors.rollout: generate failed for prompt 7 sample 0: ...
             (the same template again within 60 s: counted, not written)
    13:03:12 WARNING streamrl.actors.rollout: generate failed for prompt 9 sample 2: ...
             (12,345 more like this in the 60 s after 13:02:11)

A record is "like" another when it has the same logger, level and message template
(`record.msg` before its arguments are filled in), so a warning repeated for every
sample of a failing run costs one line a minute, not a disk. Only WARNING and above are
folded: INFO lines (a step's progress) repeat their template by design. At exit, counts
not yet written are (`report_pending`).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

WINDOW_S = 60.0
"""A template is written at most once per window; the rest are counted."""

PACED = {"is_paced": True}
"""`extra=` of a warning whose caller already limits how often it is written (the stall
report, once per `train.stall_warning_s`): never folded, each one says something new."""

MAX_TEMPLATES = 1024
"""Templates remembered at once (the oldest is forgotten first): a message built with an
f-string is its own template, and must not grow the table without bound."""


@dataclass
class _Window:
    opened_at: float
    """The filter's clock when the template was last written."""
    written_at: float
    """Its wall time (`record.created`), for the message."""
    num_folded: int = 0
    last_folded: tuple = ()
    """The last folded record's (msg, args), formatted only if a count written at exit needs
    it."""


class RepeatFilter(logging.Filter):
    """Passes the first WARNING-or-above record of a template per `window_s`; counts the
    others, and the first record after the window says how many there were."""

    def __init__(
        self, window_s: float = WINDOW_S, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        super().__init__()
        self.window_s = window_s
        self.clock = clock
        self._windows: OrderedDict[tuple[str, int, str], _Window] = OrderedDict()
        self._lock = threading.RLock()  # a handler calls its filters outside its own lock

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING or getattr(record, "is_repeat_count", False):
            return True
        if getattr(record, "is_paced", False):
            return True
        with self._lock:
            return self._is_written(record)

    def _is_written(self, record: logging.LogRecord) -> bool:
        key = (record.name, record.levelno, str(record.msg))
        now = self.clock()
        window = self._windows.get(key)
        if window is not None and now - window.opened_at < self.window_s:
            window.num_folded += 1
            window.last_folded = (record.msg, record.args)
            return False
        if window is not None and window.num_folded:
            since = time.strftime("%H:%M:%S", time.localtime(window.written_at))
            count = (
                f"({window.num_folded:,} more like this in the {self.window_s:g} s after {since})"
            )
            with contextlib.suppress(Exception):  # a bad format is the handler's to report
                record.msg, record.args = f"{record.getMessage()} {count}", None
        self._windows.pop(key, None)
        self._windows[key] = _Window(opened_at=now, written_at=record.created)
        while len(self._windows) > MAX_TEMPLATES:
            self._windows.popitem(last=False)
        return True

    @property
    def num_templates(self) -> int:
        """Templates remembered now (at most `MAX_TEMPLATES`)."""
        return len(self._windows)

    def take_pending(self) -> list[tuple[str, int, str, int]]:
        """(logger, level, the last one's message, count) of the records folded and not yet
        counted in a later one; they count as reported from now on."""
        pending = []
        with self._lock:
            for (name, level, _), window in self._windows.items():
                if window.num_folded:
                    pending.append((name, level, _message(*window.last_folded), window.num_folded))
                    window.num_folded = 0
        return pending


def _message(msg: object, args: object) -> str:
    """A record's message as logging formats it; the template alone when it does not format."""
    try:
        return str(msg) % args if args else str(msg)
    except (TypeError, ValueError, KeyError):
        return str(msg)


def configure(level: str) -> None:
    """Log to stderr at `level` (a streamrl process's only log setup: every process is
    started as `streamrl ...`), with repeats folded."""
    logging.basicConfig(
        level=level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    repeats = RepeatFilter()
    for handler in logging.getLogger().handlers:
        handler.addFilter(repeats)
    if level != "debug":  # one line per HTTP call drowns the progress lines
        for name in ("httpx", "httpx2"):  # httpx2: the openai / anthropic clients' transport
            logging.getLogger(name).setLevel(logging.WARNING)


def report_pending() -> None:
    """One line per template folded since it was last written (at exit, or before a
    process stops on an error), so no count is lost with the process."""
    handlers = logging.getLogger().handlers
    filters = [f for h in handlers for f in h.filters if isinstance(f, RepeatFilter)]
    pending = [entry for repeats in filters for entry in repeats.take_pending()]
    for name, level, last, count in pending:
        logging.getLogger(name).log(
            level,
            "%s more like this since the last one written, the last: %s",
            f"{count:,}",
            last,
            extra={"is_repeat_count": True},
        )
