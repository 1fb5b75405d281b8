"""The engine room's fixtures: `one_torch_thread`, which the modules that run tiny models in
this process use (`pytest.mark.usefixtures`), and `engine`, the session's shared engine in
one process and in two (each test that takes it runs on both)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny models run fastest single-threaded (OpenMP spin-waits hurt on a busy 2-core box)."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(params=["one process", "two processes"])
def engine(request):
    """`tiny_engine`, then `tiny_split_engine` (`--http-process on`), put back after the test."""
    shared = request.getfixturevalue(
        "tiny_engine" if request.param == "one process" else "tiny_split_engine"
    )
    yield shared
    shared.put_back()
