"""Checkpoints written in the background: what the learner copied is what resumes, and a
checkpoint is visible only once whole."""

from __future__ import annotations

import threading

import pytest
import torch

from streamrl import checkpoint
from streamrl.actors.checkpoints import BackgroundCheckpoints
from streamrl.backends import staging
from streamrl.backends.step import make_loss_fn
from streamrl.backends.torch import TorchBackend
from streamrl.metrics import MetricsWriter, read_metrics
from tests.backends.test_torch_backend import _config, _micro_batches

pytestmark = pytest.mark.anyio


def _tensors(tree) -> list[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, dict):
        return [t for key in sorted(tree, key=str) for t in _tensors(tree[key])]
    if isinstance(tree, list | tuple):
        return [t for value in tree for t in _tensors(value)]
    return []


def _assert_bit_identical(left, right) -> None:
    left, right = _tensors(left), _tensors(right)
    assert len(left) == len(right) > 0
    for a, b in zip(left, right, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.parametrize("to", ["host", "device"])
def test_a_checkpoint_written_while_training_goes_on_resumes_what_was_copied(
    tiny_model_dir, tmp_path, to
):
    cfg = _config(tiny_model_dir, algorithm={"entropy_coef": 1.0})
    loss_fn, batches = make_loss_fn(cfg), _micro_batches()

    def build():
        return TorchBackend(
            tiny_model_dir, cfg.learner, device=torch.device("cpu"), dtype=torch.float32
        )

    def train(backend) -> None:
        backend.train_mini_batch(batches, loss_fn, temperature=1.0, need_entropy=True)

    backend = build()
    train(backend)
    with staging.stage(
        {"model": backend.model.state_dict(), "optimizer": backend.optimizer.state_dict()},
        to="host",
    ).host() as copied:  # no pool: the copy stays the test's
        pass
    write = backend.stage_checkpoint(tmp_path / "checkpoint", staging=to)
    train(backend)  # the live state moves on before the copy is written
    write()
    resumed = build()
    resumed.load(tmp_path / "checkpoint")
    saved = {"model": resumed.model.state_dict(), "optimizer": resumed.optimizer.state_dict()}
    _assert_bit_identical(saved, copied)
    live = backend.model.state_dict()
    assert any(not torch.equal(live[k], v) for k, v in saved["model"].items())
    train(resumed)  # and goes on as the original did from there
    _assert_bit_identical(resumed.model.state_dict(), live)


def test_tied_weights_stay_one_tensor_in_the_copy():
    weight = torch.randn(4, 3)
    copy = staging.stage({"embed": weight, "head": weight, "other": weight.clone()}, to="host")
    with copy.host() as tree:
        pass
    assert tree["embed"] is tree["head"] and tree["other"] is not tree["embed"]
    assert torch.equal(tree["embed"], weight) and tree["embed"].data_ptr() != weight.data_ptr()


def _state(step: int) -> checkpoint.TrainState:
    return checkpoint.TrainState(step=step, version=step, next_seq=4 * step)


async def test_a_checkpoint_becomes_visible_only_once_its_write_is_complete(tmp_path):
    metrics = MetricsWriter(tmp_path, tensorboard=False)
    checkpoints = BackgroundCheckpoints(tmp_path, keep=2, metrics=metrics)
    release = threading.Event()

    def write_model() -> None:
        release.wait(30)
        (partial / "model.safetensors").write_bytes(b"weights")

    partial = checkpoint.begin(tmp_path, 3)
    files = {checkpoint.ASYNC_STATE_FILE: b"async", checkpoint.RNG_FILE: b"rng"}
    record = {"kind": "checkpoint", "step": 3, "checkpoint/stall_s": 0.01}
    checkpoints.start(_state(3), partial, write_model, files, record)
    checkpoints.collect()  # not over: nothing recorded, nothing visible
    assert checkpoint.latest(tmp_path) is None and checkpoints.is_writing
    release.set()
    assert await checkpoints.wait() >= 0.0
    path = checkpoint.latest(tmp_path)
    assert path is not None and path.name == "step_000003" and not partial.exists()
    assert (path / checkpoint.ASYNC_STATE_FILE).read_bytes() == b"async"
    assert checkpoint.read_state(path) == _state(3)
    metrics.close()
    [written] = [r for r in read_metrics(tmp_path / "metrics.jsonl") if r["kind"] == "checkpoint"]
    assert written["checkpoint/write_s"] > 0 and written["checkpoint/bytes"] > 0


async def test_a_failed_write_leaves_the_previous_checkpoint_newest_and_stops_the_learner(
    tmp_path,
):
    checkpoints = BackgroundCheckpoints(
        tmp_path, keep=2, metrics=MetricsWriter(tmp_path, tensorboard=False)
    )
    partial = checkpoint.begin(tmp_path, 2)
    checkpoints.start(_state(2), partial, lambda: None, {}, {"checkpoint/stall_s": 0.0})
    await checkpoints.wait()

    def fail() -> None:
        (partial / "half.safetensors").write_bytes(b"half")
        raise OSError("disk full")

    partial = checkpoint.begin(tmp_path, 4)
    checkpoints.start(_state(4), partial, fail, {}, {"checkpoint/stall_s": 0.0})
    with pytest.raises(RuntimeError, match="checkpoint of step 4 failed") as failed:
        await checkpoints.wait()
    assert "OSError: disk full" in str(failed.value) and "GB free under" in str(failed.value)
    assert checkpoint.latest(tmp_path).name == "step_000002"
    checkpoint.begin(tmp_path, 6)  # the next one clears what the failed one left
    assert not (checkpoint.checkpoint_dir(tmp_path) / ".partial_step_000004").exists()


async def test_a_second_checkpoint_cannot_start_while_one_is_written(tmp_path):
    checkpoints = BackgroundCheckpoints(
        tmp_path, keep=2, metrics=MetricsWriter(tmp_path, tensorboard=False)
    )
    release = threading.Event()
    partial = checkpoint.begin(tmp_path, 1)
    checkpoints.start(_state(1), partial, lambda: release.wait(30), {}, {"checkpoint/stall_s": 0})
    with pytest.raises(RuntimeError, match="still in flight"):
        checkpoints.start(_state(2), partial, lambda: None, {}, {})
    release.set()
    await checkpoints.wait()
    assert not checkpoints.is_writing


def test_a_checkpoint_that_waited_for_the_previous_write_names_the_interval_to_raise():
    from streamrl.actors.learner import _describe_checkpoint_wait

    assert _describe_checkpoint_wait(6, 0.4, 3) is None
    warning = _describe_checkpoint_wait(6, 7.7, 3)
    assert "step 6 waited 7.7 s" in warning and "train.save_interval = 3" in warning


async def test_a_checkpoint_larger_than_the_free_disk_says_so_when_it_starts(
    tmp_path, monkeypatch, caplog
):
    """The H200 run's second 21.6 GB write failed on a full disk with "unexpected pos
    15109177216 vs 15109177116" after the run had trained on; now its start warns."""
    import collections

    from streamrl.actors import checkpoints as checkpoints_module

    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(checkpoints_module.shutil, "disk_usage", lambda _: usage(100, 90, 10))
    checkpoints = BackgroundCheckpoints(
        tmp_path, keep=1, metrics=MetricsWriter(tmp_path, tensorboard=False)
    )
    partial = checkpoint.begin(tmp_path, 5)
    record = {"checkpoint/stall_s": 0.0, "checkpoint/staging_reused_bytes": 60}
    with caplog.at_level("WARNING", logger="streamrl.actors.checkpoints"):
        checkpoints.start(_state(5), partial, lambda: None, {}, record)
        await checkpoints.wait()
    [warning] = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert "checkpoint of step 5" in warning and "the write will run out of space" in warning
    assert "train.keep_checkpoints (now 1)" in warning

    caplog.clear()  # room for the staged bytes: nothing said
    monkeypatch.setattr(checkpoints_module.shutil, "disk_usage", lambda _: usage(10**12, 0, 10**12))
    partial = checkpoint.begin(tmp_path, 6)
    with caplog.at_level("WARNING", logger="streamrl.actors.checkpoints"):
        checkpoints.start(_state(6), partial, lambda: None, {}, record)
        await checkpoints.wait()
    assert not [r for r in caplog.records if r.levelname == "WARNING"]
