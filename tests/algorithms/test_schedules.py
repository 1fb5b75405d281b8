"""Learning-rate schedules at their boundary steps, against hand-computed values."""

from __future__ import annotations

import subprocess
import sys

import pytest

from streamrl.schedules import lr_at, lr_multiplier

# lr 2, min_lr 0.2, warmup W = 4, decay D = 8 (ends at step 12).
SCHEDULE = {"lr": 2.0, "warmup_steps": 4, "decay_steps": 8, "min_lr": 0.2}

# Warmup: step 0 -> 2 * 1/4 = 0.5, step W - 1 = 3 -> 2 * 4/4 = 2, step W = 4 -> p = 0 -> 2.
# Decay, lr - min_lr = 1.8:
#   step 6,  p = 2/8 = 0.25: linear 0.2 + 1.8 * 0.75 = 1.55;
#            cosine 0.2 + 1.8 * (1 + cos(pi/4)) / 2 = 0.2 + 1.8 * 0.8535534 = 1.7363961
#   step 8,  p = 0.5 (W + D/2): both 0.2 + 1.8 * 0.5 = 1.1
#   step 12, p = 1 (W + D): 0.2;  steps 13 and 10**6: 0.2.
# constant: 2 from step W on.
EXPECTED = {
    "linear": {0: 0.5, 3: 2.0, 4: 2.0, 6: 1.55, 8: 1.1, 12: 0.2, 13: 0.2, 10**6: 0.2},
    "cosine": {0: 0.5, 3: 2.0, 4: 2.0, 6: 1.7363961, 8: 1.1, 12: 0.2, 13: 0.2, 10**6: 0.2},
    "constant": {0: 0.5, 3: 2.0, 4: 2.0, 6: 2.0, 8: 2.0, 12: 2.0, 13: 2.0, 10**6: 2.0},
}


@pytest.mark.parametrize("style", ["linear", "cosine", "constant"])
def test_each_style_warms_up_then_decays_to_min_lr_at_the_boundary_steps(style):
    for step, expected in EXPECTED[style].items():
        assert lr_at(step, decay_style=style, **SCHEDULE) == pytest.approx(expected, abs=1e-7), step


@pytest.mark.parametrize("style", ["linear", "cosine", "constant"])
def test_without_warmup_step_zero_runs_at_lr_and_the_decay_starts_there(style):
    # W = 0, D = 8: step 0 -> 2; step 4 (p = 0.5) -> 1.1 for both decays; step 8 -> 0.2.
    schedule = {**SCHEDULE, "warmup_steps": 0}
    expected = {"linear": [2.0, 1.1, 0.2], "cosine": [2.0, 1.1, 0.2], "constant": [2.0, 2.0, 2.0]}
    actual = [lr_at(step, decay_style=style, **schedule) for step in (0, 4, 8)]
    assert actual == pytest.approx(expected[style], abs=1e-7)


def test_a_warmup_of_one_step_takes_the_full_rate_at_once():
    # W = 1: step 0 -> 2 * 1/1 = 2, step 1 starts the decay at p = 0 -> 2.
    schedule = {**SCHEDULE, "warmup_steps": 1}
    assert lr_at(0, decay_style="linear", **schedule) == 2.0
    assert lr_at(1, decay_style="linear", **schedule) == 2.0


def test_lr_multiplier_is_lr_at_divided_by_lr():
    factor = lr_multiplier(decay_style="cosine", **SCHEDULE)
    # 0.5 / 2, 2 / 2, 1.7363961 / 2, 0.2 / 2
    assert [factor(step) for step in (0, 3, 6, 12)] == pytest.approx(
        [0.25, 1.0, 0.8681981, 0.1], abs=1e-7
    )


def test_lr_multiplier_in_lambda_lr_gives_update_k_the_rate_lr_at_k():
    torch = pytest.importorskip("torch")
    parameter = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([parameter], lr=SCHEDULE["lr"])
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_multiplier(decay_style="linear", **SCHEDULE)
    )
    seen = []
    for _ in range(14):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    expected = [lr_at(k, decay_style="linear", **SCHEDULE) for k in range(14)]
    assert seen == pytest.approx(expected, abs=1e-12)
    assert seen[:5] == pytest.approx([0.5, 1.0, 1.5, 2.0, 2.0])


def test_lr_multiplier_checks_its_arguments_when_built():
    with pytest.raises(ValueError, match="unknown decay_style 'step'"):
        lr_multiplier(decay_style="step", **SCHEDULE)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"decay_style": "exponential"}, "unknown decay_style 'exponential'; expected one of"),
        ({"lr": 0.0}, "lr must be a finite number > 0, got 0.0"),
        ({"lr": float("inf")}, "lr must be a finite number > 0"),
        ({"min_lr": 3.0}, r"min_lr must be in \[0, lr = 2.0\], got 3.0"),
        ({"min_lr": -0.1}, r"min_lr must be in \[0, lr = 2.0\]"),
        ({"warmup_steps": -1}, "warmup_steps must be >= 0, got -1"),
        ({"warmup_steps": 2.5}, "warmup_steps must be an integer, got 2.5"),
        ({"decay_steps": 0}, "decay_steps must be >= 1 for decay_style 'linear'"),
        ({"step": -1}, "step must be >= 0, got -1"),
        ({"step": 1.0}, "step must be an integer, got 1.0"),
    ],
)
def test_lr_at_rejects_bad_arguments_with_the_name_of_the_argument(changes, message):
    arguments = {"step": 0, "decay_style": "linear", **SCHEDULE, **changes}
    with pytest.raises(ValueError, match=message):
        lr_at(**arguments)


def test_constant_style_accepts_zero_decay_steps():
    assert lr_at(100, decay_style="constant", **{**SCHEDULE, "decay_steps": 0}) == 2.0


def test_importing_the_schedules_loads_no_torch():
    probe = "import sys, streamrl.schedules\nprint('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
