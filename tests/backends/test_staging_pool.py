"""A checkpoint's copy reuses the host buffers of the previous one once its write is done
(`streamrl.backends.staging.StagingPool`); on a CPU learner they are plain host tensors."""

from __future__ import annotations

import torch

from streamrl.actors.learner import _describe_buffers
from streamrl.backends import staging
from streamrl.backends.step import make_loss_fn
from streamrl.backends.torch import TorchBackend
from tests.backends.test_torch_backend import _config, _micro_batches


def _state() -> dict:
    return {"weight": torch.randn(4, 3), "optimizer": {"exp_avg": torch.randn(5), "step": 3}}


def _pointers(tree: dict) -> list[int]:
    return [tree["weight"].data_ptr(), tree["optimizer"]["exp_avg"].data_ptr()]


def test_a_second_copy_reuses_the_buffers_of_a_first_whose_write_is_done():
    pool, state = staging.StagingPool(), _state()
    with staging.stage(state, to="host", pool=pool).host() as first:
        first_pointers = _pointers(first)
    assert pool.reuse() == staging.Reuse(allocated_bytes=(12 + 5) * 4)
    state["weight"].add_(1.0)  # training goes on between the checkpoints
    with staging.stage(state, to="host", pool=pool).host() as second:
        assert _pointers(second) == first_pointers
        assert torch.equal(second["weight"], state["weight"])
        assert second["weight"].data_ptr() != state["weight"].data_ptr()
        assert second["optimizer"]["step"] == 3
    assert pool.reuse() == staging.Reuse(reused_bytes=(12 + 5) * 4)


def test_buffers_that_a_write_still_reads_are_not_reused():
    pool, state = staging.StagingPool(), _state()
    old_weight = state["weight"].clone()
    with staging.stage(state, to="host", pool=pool).host() as first:
        state["weight"].add_(1.0)
        with staging.stage(state, to="host", pool=pool).host() as second:
            assert set(_pointers(second)).isdisjoint(_pointers(first))
            assert pool.reuse().reused_bytes == 0
        assert torch.equal(first["weight"], old_weight)  # the write reads what it copied


def test_a_changed_tree_reuses_the_buffers_that_fit_and_drops_the_rest():
    pool = staging.StagingPool()
    with staging.stage({"a": torch.ones(4, 3), "b": torch.ones(5)}, to="host", pool=pool).host():
        pass
    changed = {"c": torch.ones(2, 2, dtype=torch.bfloat16), "a": torch.zeros(4, 3)}
    with staging.stage(changed, to="host", pool=pool).host() as copy:
        assert torch.equal(copy["a"], changed["a"]) and torch.equal(copy["c"], changed["c"])
    assert pool.reuse() == staging.Reuse(reused_bytes=12 * 4, allocated_bytes=4 * 2)
    assert sorted(b.numel() for b in pool.take("policy")) == [4, 12]  # b's buffer let go


def test_tied_weights_stay_one_buffer_when_reused():
    pool, weight = staging.StagingPool(), torch.randn(4, 3)
    for _ in range(2):
        with staging.stage({"embed": weight, "head": weight}, to="host", pool=pool).host() as tree:
            assert tree["embed"] is tree["head"]
    assert pool.reuse() == staging.Reuse(reused_bytes=12 * 4)


def test_a_backends_second_checkpoint_copies_the_new_state_into_the_first_ones_buffers(
    tiny_model_dir, tmp_path
):
    cfg = _config(tiny_model_dir)
    loss_fn, batches = make_loss_fn(cfg), _micro_batches()

    def build() -> TorchBackend:
        return TorchBackend(
            tiny_model_dir, cfg.learner, device=torch.device("cpu"), dtype=torch.float32
        )

    def train(backend: TorchBackend) -> None:
        backend.train_mini_batch(batches, loss_fn, temperature=1.0, need_entropy=False)

    backend = build()
    train(backend)
    backend.stage_checkpoint(tmp_path / "first")()
    allocated = backend.staging_pool.reuse().allocated_bytes
    assert allocated > 0
    train(backend)
    write = backend.stage_checkpoint(tmp_path / "second")
    assert backend.staging_pool.reuse() == staging.Reuse(reused_bytes=allocated)
    write()
    resumed = build()
    resumed.load(tmp_path / "second")
    live = backend.model.state_dict()
    for name, value in resumed.model.state_dict().items():
        assert torch.equal(value, live[name]), name


def test_the_log_says_what_the_copy_reused_and_allocated():
    assert _describe_buffers(60_100_000_000, 0) == ", reused 60.10 GB of staging buffers"
    assert _describe_buffers(0, 2_000_000_000) == ", allocated 2.00 GB of staging buffers"
    assert _describe_buffers(0, 0) == ""


def test_a_reservation_notes_a_copys_buffers_and_copies_nothing_until_they_are_allocated():
    pool, state = staging.StagingPool(), _state()
    staged = staging.stage(state, to="reserve", pool=pool)
    with staged.host() as nothing:
        assert nothing is None
    assert pool.pending and pool.reuse() == staging.Reuse()  # a reservation is not a copy
    pool.allocate_pending(60.0)
    assert not pool.pending and pool.reserved["policy"][0] == (12 + 5) * 4
    with staging.stage(state, to="host", pool=pool).host() as copy:
        assert torch.equal(copy["weight"], state["weight"])
    assert pool.reuse() == staging.Reuse(reused_bytes=(12 + 5) * 4)


def test_a_copy_allocates_the_rest_of_its_reservation_itself():
    pool, state = staging.StagingPool(), _state()
    staging.stage(state, to="reserve", pool=pool)
    pool.allocate_pending(0.0)  # no time: nothing allocated
    assert pool.pending and "policy" not in pool.reserved
    with staging.stage(state, to="host", pool=pool).host() as copy:
        assert torch.equal(copy["weight"], state["weight"])
    assert not pool.pending
    # what the copy allocated counts as allocated (the H200 log read "reused 21.61 GB" for a
    # copy that page-locked part of them itself), and the next copy reuses it all
    assert pool.reuse() == staging.Reuse(allocated_bytes=(12 + 5) * 4)
    with staging.stage(state, to="host", pool=pool).host():
        pass
    assert pool.reuse() == staging.Reuse(reused_bytes=(12 + 5) * 4)


def test_a_backend_reserves_its_first_checkpoints_buffers_and_writes_nothing(
    tiny_model_dir, tmp_path
):
    cfg = _config(tiny_model_dir)
    backend = TorchBackend(
        tiny_model_dir, cfg.learner, device=torch.device("cpu"), dtype=torch.float32
    )
    backend.train_mini_batch(_micro_batches(), make_loss_fn(cfg), temperature=1.0,
                             need_entropy=False)  # fmt: skip
    backend.stage_checkpoint(tmp_path / "reserve", staging="reserve")()
    assert not (tmp_path / "reserve").exists()
    backend.staging_pool.allocate_pending(60.0)
    write = backend.stage_checkpoint(tmp_path / "first")
    reuse = backend.staging_pool.reuse()
    assert (
        reuse.allocated_bytes == 0
        and reuse.reused_bytes == backend.staging_pool.reserved["policy"][0] > 0
    )
    write()
    assert (tmp_path / "first" / "optimizer.pt").exists()
