"""`weights.update_interval` (slime's --update-weights-interval): weights reach the engines
every N versions. Admission's arithmetic decides which N can make progress; the config
refuses the others, and `streamrl from-slime` maps the flag."""

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
