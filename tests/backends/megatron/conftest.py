"""The Megatron room's fixture: `rank_runs`, the requesting test file's runs of itself as gloo
ranks (`megatron_ranks.RankRuns`), stopped when its module ends.

The modules that use it name `pytest.mark.xdist_group("megatron")`: their ranks are forked
from one forkserver per test process (`forked_ranks`), which imports torch, transformers and
megatron-core when it starts (about 7 CPU-s); on one pytest-xdist worker they share one."""

from __future__ import annotations

import pytest
from megatron_ranks import RankRuns


@pytest.fixture(scope="module")
def rank_runs(request, tmp_path_factory):
    """Start a run with `rank_runs.start(mode, world_size, *args, timeout_s=...)`; a test
    reads it with `rank_runs(mode)`, which waits for it."""
    runs = RankRuns(request.path, tmp_path_factory.mktemp(request.path.stem))
    yield runs
    runs.stop()
