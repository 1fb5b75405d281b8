"""Rank 0's side of learner ranks 1..N-1 (`streamrl.mains.ranks`), whichever launcher
starts them: a rank that exits before the rendezvous fails the start at once, naming it;
such an error raised inside task groups is what `streamrl run` prints."""

from __future__ import annotations

import sys
import time

import pytest
import torch

from streamrl.config import config_from_dict
from streamrl.mains.ranks import RankLost, start_learner_ranks
from streamrl.process import LocalSpawner, spawn


class FailingRankSpawner(LocalSpawner):
    """Starts every rank as a process that prints a line and exits 3 (a rank whose node lacks
    the run directory, say), in place of `streamrl _learner`."""

    def spawn(self, name, argv, *, log_path=None, env=None):
        code = "print('cannot read learner.json'); raise SystemExit(3)"
        return spawn(name, [sys.executable, "-c", code], log_path=log_path, env=env)


def test_a_rank_that_exits_before_the_rendezvous_fails_the_start_at_once_naming_it(tmp_path):
    cfg = config_from_dict(
        {
            "data": {"path": "builtin:arithmetic"},
            "learner": {"backend": "megatron", "num_gpus": 2, "device": "cpu"},
        }
    )
    started = time.monotonic()
    with pytest.raises(RankLost) as failure:
        start_learner_ranks(
            cfg, tmp_path, FailingRankSpawner(), torch.device("cpu"), rendezvous_timeout_s=30
        )
    assert time.monotonic() - started < 15  # not the rendezvous timeout
    message = str(failure.value)
    assert "learner rank 1 (on this machine" in message
    assert "exited with code 3 before the rendezvous" in message
    assert "No checkpoint was written yet" in message
    assert "cannot read learner.json" in message  # the tail of its log
    events = (tmp_path / "events.jsonl").read_text()
    assert '"event": "ranks_started"' in events


def test_a_known_error_inside_task_groups_is_what_streamrl_run_reports():
    from streamrl.launch.run import _first_known

    lost = RankLost("learner rank 1 (Ray node n1 at 10.0.0.2, pid 7) exited with code -9")
    nested = ExceptionGroup("outer", [ValueError("noise"), ExceptionGroup("inner", [lost])])
    assert _first_known(nested) is lost
    assert _first_known(ExceptionGroup("only noise", [ValueError("x")])) is None
