"""Stopping what a run started in bounded time: `stop_all` stops every process at once, and
`kill_survivors` kills by pid what outlived its grace, never a process that reused the pid;
and the ports `free_port` hands the processes a run starts."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading

import pytest
from engine_helpers import wait_until
from run_helpers import is_gone

from streamrl.launch.ray.hosts import kill_survivors, start_time
from streamrl.process import stop_all


def test_stop_all_runs_every_stop_at_once_and_raises_the_first_error_after_all_returned():
    arrived = threading.Barrier(3, timeout=60)  # opens only while all three stops wait at once
    finished = []

    def stop() -> None:
        arrived.wait()
        finished.append(True)

    def failing_stop() -> None:
        arrived.wait()
        raise RuntimeError("engine-1 did not stop")

    with pytest.raises(RuntimeError, match="engine-1 did not stop"):
        stop_all([stop, failing_stop, stop])
    assert finished == [True, True]


def test_kill_survivors_kills_what_outlived_its_grace_and_leaves_a_reused_pid_alone():
    exited = subprocess.Popen(["true"])
    wait_until(lambda: is_gone(exited.pid), what="the short process to exit")
    ignores_term = [sys.executable, "-c",
                    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                    "time.sleep(600)"]  # fmt: skip
    stuck = subprocess.Popen(ignores_term, start_new_session=True)
    other = subprocess.Popen(["sleep", "600"])
    try:
        wait_until(lambda: start_time(stuck.pid) is not None, what="the stuck process")
        processes = {
            exited.pid: start_time(exited.pid),
            stuck.pid: start_time(stuck.pid),
            other.pid: start_time(other.pid) + 1,  # as if the pid now named another process
        }
        assert kill_survivors(processes, grace_s=0.5) == [stuck.pid]
        assert stuck.wait(timeout=30) == -signal.SIGKILL
        assert other.poll() is None
    finally:
        stuck.kill()
        other.kill()
        for process in (exited, stuck, other):
            process.wait()
    assert start_time(stuck.pid) is None


def test_a_free_port_is_bindable_and_outside_the_range_outgoing_connections_take():
    import random
    import socket

    from streamrl.process import _ephemeral_range, free_port

    low, high = _ephemeral_range()
    random.seed(0)  # a seeded process (every streamrl process seeds) still gets its own picks
    ports = {free_port() for _ in range(20)}
    assert len(ports) > 15
    for port in ports:
        assert not low <= port <= high, (port, low, high)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", ports.pop()))


HUNG_RUN = """
import signal, sys, threading
from streamrl.launch.run import _Interrupt

class Trainer:
    def stop(self):
        print("children stopped", file=sys.stderr, flush=True)

_Interrupt.STOP_GRACE_S = 0.5
signal.signal(signal.SIGTERM, _Interrupt(Trainer()))
try:  # ready only inside: a SIGTERM before the try would end the script as an interrupt
    print("ready", flush=True)
    threading.Event().wait()
except KeyboardInterrupt:
    threading.Event().wait()  # a stop that never ends, as a thread holding the exit would
"""


def test_a_run_whose_stop_hangs_after_sigterm_is_ended_by_the_watchdog_with_its_stacks():
    process = subprocess.Popen(
        [sys.executable, "-c", HUNG_RUN], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        assert process.stdout.readline() == "ready\n"
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 130
    finally:
        process.kill()
    stderr = process.stderr.read()
    assert "still stopping 0 s after the interrupt; every thread's stack:" in stderr
    assert "threading.py" in stderr  # the dumped stacks
    assert "children stopped" in stderr
    assert "interrupted; every process stopped (by the watchdog)" in stderr


def test_an_interrupt_wrapped_in_a_task_groups_exception_group_reads_as_an_interrupt():
    """Ctrl-C lands wherever the run is: inside a task group it arrives as an exception group,
    and summary.json must still say the run was interrupted (fresh52 wrote the group's name)."""
    import anyio

    from streamrl.mains.trainer import INTERRUPTED, stop_reason

    async def reasons() -> list[str]:  # as the run reads them: inside its event loop
        cancelled = anyio.get_cancelled_exc_class()
        nested = BaseExceptionGroup("outer", [BaseExceptionGroup("inner", [cancelled()])])
        return [
            stop_reason(KeyboardInterrupt()),
            stop_reason(BaseExceptionGroup("tg", [KeyboardInterrupt()])),
            stop_reason(nested),
            stop_reason(BaseExceptionGroup("tg", [KeyboardInterrupt(), ValueError("bad")])),
        ]

    *interrupted, mixed = anyio.run(reasons)
    assert interrupted == [INTERRUPTED] * 3
    assert mixed.startswith("BaseExceptionGroup")
