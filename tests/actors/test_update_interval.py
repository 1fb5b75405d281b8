"""`weights.update_interval` (slime's --update-weights-interval): weights reach the engines
every N versions. Admission's arithmetic decides which N can make progress; the config
refuses the others; the learner loop (a real tiny torch learner) pushes the multiples of N
and its last version, after a resume too; `streamrl from-slime` maps the flag. The run
itself: tests/runs/test_run.py."""

from __future__ import annotations

import pytest

from streamrl.compat.slime.command_line import convert
from streamrl.compat.slime.scripts import read_command
from streamrl.config import ConfigError, config_from_dict
from streamrl.queues.admission import Admission


def _config(**sections):
    return config_from_dict({"data": {"path": "builtin:arithmetic"}, **sections})


def _simulate(*, interval: int, eta: int, num_steps: int, batch_size: int = 2):
    """A run in which generation is instant: the rollout starts every group admission
    allows (each group's tokens carry the version the engines serve), the learner trains
    `batch_size` of them per step and the publisher pushes every `interval` versions, as the
    learner loop does. Returns (steps trained before the learner would wait forever, the
    largest learner version minus a trained group's version)."""
    buffered: list[int] = []  # the version each buffered group was generated with
    admission = Admission(
        batch_size=batch_size,
        max_staleness=eta,
        capacity=(eta + 2) * batch_size,  # the run's default buffer.capacity
        num_buffered=lambda: len(buffered),
    )
    served, staleness = 0, 0
    for step in range(num_steps):
        version = step  # the learner's version when it takes step + 1's batch
        startable = admission.available()
        admission.granted(startable)
        for _ in range(startable):
            admission.returned()
            buffered.append(served)
        if len(buffered) < batch_size:
            return step, staleness
        batch, buffered[:] = buffered[:batch_size], buffered[batch_size:]
        staleness = max(staleness, *(version - generated for generated in batch))
        if (version + 1) % interval == 0:
            served = version + 1
            admission.set_version(served)
    return num_steps, staleness


@pytest.mark.parametrize("eta", [0, 1, 2, 3])
def test_an_interval_up_to_max_staleness_plus_one_progresses_and_keeps_the_bound(eta):
    for interval in range(1, eta + 6):
        num_steps, staleness = _simulate(interval=interval, eta=eta, num_steps=30)
        if interval <= eta + 1:
            assert num_steps == 30, (interval, eta)
            assert staleness <= eta, (interval, eta)
            _config(buffer={"max_staleness": eta}, weights={"update_interval": interval})
        else:
            # The learner stops eta + 1 versions past the last push, as the config says.
            assert num_steps == eta + 1, (interval, eta)
            with pytest.raises(ConfigError, match=r"weights\.update_interval.*max_staleness"):
                _config(buffer={"max_staleness": eta}, weights={"update_interval": interval})


def test_the_refusal_names_both_keys_and_each_way_out_is_accepted():
    with pytest.raises(ConfigError) as info:
        _config(buffer={"max_staleness": 1}, weights={"update_interval": 4})
    message = str(info.value)
    assert "weights.update_interval = 4" in message
    assert "buffer.max_staleness >= 3" in message and "weights.update_interval <= 2" in message
    _config(buffer={"max_staleness": 3}, weights={"update_interval": 4})
    _config(buffer={"max_staleness": 1}, weights={"update_interval": 2})


def test_sync_mode_pushes_every_version_and_modes_without_a_publisher_take_any_interval():
    with pytest.raises(ConfigError, match=r"weights\.update_interval = 2 with train\.mode"):
        _config(train={"mode": "sync"}, weights={"update_interval": 2})
    assert _config(train={"mode": "sync"}).weights.update_interval == 1
    rollout_only = _config(train={"mode": "rollout_only"}, weights={"update_interval": 5})
    assert rollout_only.weights.update_interval == 5


def _converted(*words: str):
    return convert(read_command([], ["python", *words]))


def test_from_slime_maps_the_interval_and_raises_the_staleness_bound_it_needs():
    conversion = _converted("train_async.py", "--update-weights-interval", "4")
    assert conversion.get("weights.update_interval") == 4
    assert conversion.get("buffer.max_staleness") == 3
    assert not any("--update-weights-interval" in text for text, _ in conversion.not_mapped)
    cfg = _config(buffer=conversion.raw["buffer"], weights=conversion.raw["weights"])
    assert (cfg.weights.update_interval, cfg.buffer.max_staleness) == (4, 3)
    # An interval the default bound (1) already allows leaves the bound alone.
    conversion = _converted("train_async.py", "--update-weights-interval", "2")
    assert conversion.get("buffer.max_staleness") is None


def test_from_slime_lists_an_interval_of_the_synchronous_driver_as_not_mapped():
    conversion = _converted("train.py", "--update-weights-interval", "2")
    assert conversion.get("weights.update_interval") is None
    reasons = dict(conversion.not_mapped)
    assert "synchronous" in reasons["--update-weights-interval 2"]


class FixedSource:
    """A step source that hands out the same trainable group for every step."""

    def __init__(self) -> None:
        from streamrl.types import Group, Sample

        samples = [
            Sample(
                prompt_ids=[1, 5, 6],
                response_ids=[20 + i, 30, 40],
                logprobs=[-3.0] * 3,
                versions=[0] * 3,
                loss_mask=[1] * 3,
                reward=float(i),
            )
            for i in range(2)
        ]
        self.group = Group(group_id="g", prompt_seq=0, prompt_index=0, samples=samples)

    async def take(self, num_groups: int, version: int):
        return [self.group] * num_groups

    def stats(self):
        from streamrl.queues.buffer import BufferStats
        from streamrl.queues.progress import SourceStats

        return SourceStats(buffer=BufferStats(), num_buffered=0, max_staleness=2)

    def progress(self, num_needed: int):
        raise AssertionError("the batch is always there")

    async def snapshot(self, step: int, *, timeout_s: float):
        raise AssertionError("no checkpoint in these runs")

    @property
    def done_seqs(self) -> set[int]:
        return set()

    def pop_eval_reports(self) -> list:
        return []


class RecordingPublisher:
    """Records the versions the learner loop hands over (the ones the engines receive)."""

    num_digest_mismatches = 0

    def __init__(self) -> None:
        self.versions: list[int] = []
        self.records: list = []

    async def publish(self, version: int):
        from streamrl.publish.publisher import PublishRecord

        self.versions.append(version)
        self.records.append(PublishRecord(version=version))
        return self.records[-1]

    async def wait_idle(self) -> None:
        pass


@pytest.fixture(scope="module")
def tiny_backend(tiny_model_dir):
    import torch

    from streamrl.backends.build import build_backend

    cfg = _loop_config(tiny_model_dir, steps=1)
    return build_backend(cfg, tiny_model_dir, torch.device("cpu"), torch.float32)


def _loop_config(model_dir: str, *, steps: int):
    return _config(
        model={"path": model_dir},
        rollout={"batch_size": 1, "n_samples_per_prompt": 2},
        buffer={"max_staleness": 2},
        weights={"update_interval": 3},
        learner={"device": "cpu", "lr": 1e-5},
        train={"steps": steps},
        logging={"tensorboard": False, "progress": False},
    )


@pytest.mark.anyio
@pytest.mark.parametrize(
    "start, steps, pushed",
    [
        (0, 5, [3, 5]),  # multiples of 3, then the last version
        (4, 7, [6, 7]),  # a resume at version 4: its engines start on 4
        (6, 6, []),  # a resume with nothing left to train pushes nothing
    ],
)
async def test_the_learner_pushes_multiples_of_the_interval_and_its_last_version(
    tiny_backend, tiny_model_dir, tmp_path, start, steps, pushed
):
    from streamrl import checkpoint
    from streamrl.actors.learner import LearnerLoop
    from streamrl.metrics import MetricsWriter

    publisher = RecordingPublisher()
    metrics = MetricsWriter(tmp_path, tensorboard=False, progress=False)
    loop = LearnerLoop(
        _loop_config(tiny_model_dir, steps=steps),
        backend=tiny_backend,
        source=FixedSource(),
        publisher=publisher,
        metrics=metrics,
        run_dir=tmp_path,
        state=checkpoint.TrainState(step=start, version=start),
        pad_id=0,
    )
    state = await loop.run()
    metrics.close()
    assert (state.step, state.version) == (steps, steps)
    assert publisher.versions == pushed
