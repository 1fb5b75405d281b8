"""Repeated warnings are written once a window and counted (`streamrl.logs`), on a fake clock."""

from __future__ import annotations

import io
import logging
from dataclasses import dataclass

import pytest

from streamrl.logs import MAX_TEMPLATES, PACED, RepeatFilter, report_pending


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Logged:
    logger: logging.Logger
    clock: FakeClock
    stream: io.StringIO
    repeats: RepeatFilter

    def lines(self) -> list[str]:
        return self.stream.getvalue().splitlines()


@pytest.fixture
def logged():
    """A logger whose records reach a root handler that folds repeats on a fake clock."""
    clock = FakeClock()
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    repeats = RepeatFilter(60.0, clock=clock)
    handler.addFilter(repeats)
    logger = logging.getLogger("tests.repeats")
    logger.setLevel(logging.DEBUG)
    logging.getLogger().addHandler(handler)
    yield Logged(logger, clock, stream, repeats)
    logging.getLogger().removeHandler(handler)
    logger.setLevel(logging.NOTSET)


def test_a_warning_repeated_within_the_window_is_written_once_then_counted(logged):
    logger, clock = logged.logger, logged.clock
    for index in range(1_235):
        logger.warning("generate failed for prompt %d: %r", index, RuntimeError("boom"))
        clock.now += 0.001
    assert logged.lines() == [
        "WARNING tests.repeats: generate failed for prompt 0: RuntimeError('boom')"
    ]
    clock.now += 60.0
    logger.warning("generate failed for prompt %d: %r", 99_999, RuntimeError("boom"))
    (_, second) = logged.lines()
    assert second.startswith("WARNING tests.repeats: generate failed for prompt 99999: ")
    assert "(1,234 more like this in the 60 s after " in second


def test_templates_loggers_and_levels_are_folded_separately_and_info_never(logged):
    logger = logged.logger
    for _ in range(3):
        logger.warning("one %d", 1)
        logger.warning("two %d", 2)
        logger.error("one %d", 1)
        logger.info("step %d", 3)
        logging.getLogger("tests.repeats.child").warning("one %d", 1)
    assert logged.lines() == [
        "WARNING tests.repeats: one 1",
        "WARNING tests.repeats: two 2",
        "ERROR tests.repeats: one 1",
        "INFO tests.repeats: step 3",
        "WARNING tests.repeats.child: one 1",
        "INFO tests.repeats: step 3",
        "INFO tests.repeats: step 3",
    ]


def test_a_repeat_after_a_quiet_window_is_written_without_a_count(logged):
    logger, clock = logged.logger, logged.clock
    logger.warning("engine call failed (%s)", "timeout")
    clock.now += 61.0
    logger.warning("engine call failed (%s)", "timeout")
    assert logged.lines() == ["WARNING tests.repeats: engine call failed (timeout)"] * 2


def test_counts_still_folded_at_exit_are_written_once_one_line_per_template(logged):
    logger = logged.logger
    for i in range(5):
        logger.warning("a %d", i)
        logger.warning("b %d", 10 + i)
    report_pending()
    assert logged.lines()[2:] == [
        "WARNING tests.repeats: 4 more like this since the last one written, the last: a 4",
        "WARNING tests.repeats: 4 more like this since the last one written, the last: b 14",
    ]
    report_pending()  # each count is written once
    assert len(logged.lines()) == 4
    assert logged.repeats.take_pending() == []


def test_messages_that_are_each_their_own_template_do_not_grow_the_table(logged):
    logger = logged.logger
    for index in range(MAX_TEMPLATES + 10):
        logger.warning(f"unique {index}")
    assert len(logged.lines()) == MAX_TEMPLATES + 10
    assert logged.repeats.num_templates == MAX_TEMPLATES


def test_a_paced_warning_is_written_every_time(logged):
    for step in range(3):  # its caller already writes it once an interval
        logged.logger.warning("stalled before step %d", step, extra=PACED)
    assert len(logged.lines()) == 3
