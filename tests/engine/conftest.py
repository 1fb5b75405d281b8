"""The engine room's fixture: `one_torch_thread`, which the modules that run tiny models in
this process use (`pytest.mark.usefixtures`)."""

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
