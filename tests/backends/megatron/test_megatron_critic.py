"""The critic of `advantage_estimator = "gae"` with the Megatron learner, on CPU (gloo).

Two real runs of this file as a script start together in a module fixture (`python
tests/backends/megatron/test_megatron_critic.py worker MODE OUT START_DIR MODEL_DIR`,
megatron_ranks.py): one rank trains a GAE critic from the tiny model and saves and resumes
it; two ranks build the critic of a starting directory (a value head already trained, say)
at TP 2, TP 2 with sequence parallelism and PP 2, and train one at TP 2 with sequence
parallelism through the leader and follower calls of a run (`streamrl.backends.ranks`).

How close TP 2 values must be to TP 1's is derived, not chosen: `rounding_bound` is a
first-order bound E on how far a float32 computation of the values can be from the exact
ones (every op's rounding, weighted by the value's float64 sensitivity to it); two layouts
that each stay within E of the exact values are within 2E of each other. Its ops are Hugging
Face's (Megatron fuses some of them: QKV, gate/up), each bounded as any order of its sums
rounds (gamma_n); a worst case, so it sits far above the differences seen (about 1e-6
against a bound of a few 1e-3 on values of order 1), and far below a wrong shard or gather.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron_ranks import seeded_micro_batches, worker_main

# One worker forks every rank of this room (conftest.py of this room says why).
pytestmark = pytest.mark.xdist_group("megatron")

RUN_TIMEOUT_S = 240.0
NUM_STEPS = 12
LAYOUTS = {
    "tp2": {"tensor_parallel_size": 2},
    "tp2_sp": {"tensor_parallel_size": 2, "sequence_parallel": True},
    "pp2": {"pipeline_parallel_size": 2},
}


def run_config(model_dir: str, critic_path: str = "", **megatron):
    from streamrl.config import config_from_dict

    return config_from_dict(
        {
            "data": {"path": "x"},
            "model": {"path": model_dir},
            "rollout": {"batch_size": 2, "n_samples_per_prompt": 2},
            "algorithm": {"advantage_estimator": "gae", "value_clip": 0.0},
            "learner": {
                "backend": "megatron",
                "device": "cpu",
                "num_gpus": megatron.get("tensor_parallel_size", 1)
                * megatron.get("pipeline_parallel_size", 1),
                "lr": 1e-4,
                "critic": {"path": critic_path, "lr": 3e-3},
                "megatron": {"use_distributed_optimizer": False, **megatron},
            },
        }
    )


def fixed_micro_batches():
    """Two right-padded micro-batches with trained positions past a 3-token prompt."""
    return seeded_micro_batches(
        [[11, 8, 10], [9, 6]], token_ids=range(10, 2000),
        generator=torch.Generator().manual_seed(21), prompt_tokens=3,
    )  # fmt: skip


# ---------------------------------------------------------------- the workers (a script)


def _gae_steps(backend, cfg, num_steps: int) -> list[dict[str, float]]:
    from test_critic import _groups

    from streamrl.backends.step import train_step

    groups = _groups()
    return [train_step(backend, groups, cfg, pad_id=0) for _ in range(num_steps)]


def _worker_single(out: Path, start_dir: str, model_dir: str) -> None:
    from test_critic import _groups

    from streamrl.backends.build import build_backend
    from streamrl.backends.step import train_step

    cpu, fp32 = torch.device("cpu"), torch.float32
    cfg = run_config(model_dir)
    backend = build_backend(cfg, model_dir, cpu, fp32)
    results = {"steps": _gae_steps(backend, cfg, NUM_STEPS)}
    checkpoint = out.parent / "checkpoint"
    backend.save(checkpoint)
    resumed = build_backend(cfg, str(checkpoint), cpu, fp32, reference_path=model_dir)
    resumed.load(checkpoint)
    results["values"] = backend.critic.compute_values(fixed_micro_batches())
    results["values_resumed"] = resumed.critic.compute_values(fixed_micro_batches())
    results["next_step"] = train_step(backend, _groups(), cfg, pad_id=0)
    results["next_step_resumed"] = train_step(resumed, _groups(), cfg, pad_id=0)
    start = build_backend(run_config(model_dir, start_dir), model_dir, cpu, fp32)
    results["start_values"] = start.critic.compute_values(fixed_micro_batches())
    torch.save(results, out)


def _worker_two(out: Path, start_dir: str, model_dir: str) -> None:
    import torch.distributed as dist

    from streamrl.backends.build import build_backend
    from streamrl.backends.ranks import Leader, follow
    from streamrl.backends.step import make_loss_fn, make_value_loss_fn

    rank = dist.get_rank()
    results: dict = {"start_values": {}}
    cpu, fp32 = torch.device("cpu"), torch.float32
    for label, megatron in LAYOUTS.items():
        cfg = run_config(model_dir, start_dir, **megatron)
        backend = build_backend(cfg, model_dir, cpu, fp32)
        batches = fixed_micro_batches() if rank == 0 else []
        results["start_values"][label] = backend.critic.compute_values(batches)
    # The last backend trains from the tiny model's zero head, as a run's ranks do.
    cfg = run_config(model_dir, **LAYOUTS["tp2_sp"])
    backend = build_backend(cfg, model_dir, cpu, fp32)
    if rank == 0:
        leader = Leader(backend)
        results["steps"] = _gae_steps(leader, cfg, NUM_STEPS)
        leader.close()
    else:
        follow(backend, make_loss_fn(cfg), value_loss_fn=make_value_loss_fn(cfg))
    head = backend.critic.model.output_layer
    results["head"] = torch.cat([head.weight.detach().flatten(), head.bias.detach()])
    torch.save(results, out if rank == 0 else out.parent / f"rank{rank}.pt")


# ---------------------------------------------------------------- the rounding bound

UNIT_ROUNDOFF = 2.0**-24
"""float32's u: a correctly rounded operation returns x (1 + d) with |d| <= u."""
TRANSCENDENTAL_ULPS = 4
"""Bound on the error of exp, sin, cos, rsqrt in units of u (torch's CPU kernels: <= 3.5 ulp)."""

EXACT_OPS = {"embedding", "zeros", "tensor", "where", "cat", "view", "reshape", "transpose"}
EXACT_OPS |= {"unsqueeze", "__getitem__", "neg", "expand", "contiguous", "dropout"}
"""Ops that move or select values without rounding (dropout: p = 0 in eval)."""


def _gamma(n: int) -> float:
    """gamma_n = n u / (1 - n u): the relative error bound of a sum or dot product of n terms
    in any order (Higham, Accuracy and Stability of Numerical Algorithms, section 3.1)."""
    return n * UNIT_ROUNDOFF / (1 - n * UNIT_ROUNDOFF)


def _op_error(name: str, args: tuple, kwargs: dict, out: torch.Tensor) -> torch.Tensor:
    """Bound on |computed - exact| of one op's output, elementwise, for exact operands."""
    magnitude = out.abs()
    if name == "linear":
        x, weight = args[0], args[1] if len(args) > 1 else kwargs["weight"]
        bias = args[2] if len(args) > 2 else kwargs.get("bias")
        terms = x.abs() @ weight.abs().T + (0 if bias is None else bias.abs())
        return _gamma(weight.shape[-1] + (bias is not None)) * terms
    if name in ("matmul", "__matmul__"):
        a, b = args
        return _gamma(a.shape[-1]) * (a.abs() @ b.abs())
    if name == "mean":
        (x, *_), n = args, args[0].numel() // max(out.numel(), 1)
        return _gamma(n + 1) * x.abs().mean(*args[1:], **kwargs)
    if name == "softmax":
        dim = kwargs.get("dim", args[1] if len(args) > 1 else -1)
        n = args[0].shape[dim]
        # exp in the numerator and in each term of the sum, the sum, the division
        return (_gamma(n) + (2 * TRANSCENDENTAL_ULPS + 1) * UNIT_ROUNDOFF) * magnitude
    if name in ("mul", "__mul__", "add", "__add__", "pow", "float", "to"):  # casts to float32
        return UNIT_ROUNDOFF * magnitude
    if name in ("cos", "sin", "rsqrt"):
        return TRANSCENDENTAL_ULPS * UNIT_ROUNDOFF * magnitude
    if name == "silu":  # x / (1 + exp(-x)): exp, an addition, a division
        return (TRANSCENDENTAL_ULPS + 2) * UNIT_ROUNDOFF * magnitude
    raise NotImplementedError(f"no rounding bound for the op {name!r}")


def rounding_bound(model_dir: str, micro_batches) -> list[torch.Tensor]:
    """E [B, T] per micro-batch: a first-order bound on |float32 value - exact value| at each
    trained position, 0 elsewhere.

    The critic's body and head run in float64 (Hugging Face's eager attention; the values are
    its function) under a TorchFunctionMode that adds a zero leaf to every rounding op's
    output and records the op's error bound for exact operands. With J the value's gradient
    with respect to those leaves, to first order |computed - exact| <= sum |J| * bound."""
    from safetensors.torch import load_file
    from torch.overrides import TorchFunctionMode
    from transformers import AutoModel

    class Recorder(TorchFunctionMode):
        def __init__(self) -> None:
            super().__init__()
            self.leaves: list[tuple[torch.Tensor, torch.Tensor]] = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            name = getattr(func, "__name__", repr(func))
            if not isinstance(out, torch.Tensor) or not out.is_floating_point():
                return out
            if name in EXACT_OPS or (name in ("float", "to") and out.dtype == torch.float64):
                return out
            with torch.no_grad():
                error = _op_error(name, args, kwargs, out)
            leaf = torch.zeros_like(out, requires_grad=True)
            self.leaves.append((leaf, error))
            return out + leaf

    body = AutoModel.from_pretrained(model_dir, dtype=torch.float64, attn_implementation="eager")
    head = load_file(str(Path(model_dir) / "model.safetensors"))
    weight, bias = head["value_head.weight"].double(), head["value_head.bias"].double()
    body.eval()
    bounds = []
    for micro_batch in micro_batches:
        recorder = Recorder()
        with recorder:
            hidden = body(
                input_ids=micro_batch.input_ids, attention_mask=micro_batch.attention_mask
            ).last_hidden_state
            scores = torch.nn.functional.linear(hidden, weight, bias)[..., 0]
        rows, positions = (micro_batch.loss_mask > 0).nonzero().unbind(1)
        values = scores[rows, positions - 1]  # V before token t is the score at t - 1
        leaves, errors = zip(*recorder.leaves, strict=True)
        one_value_each = torch.eye(len(values), dtype=values.dtype)
        gradients = torch.autograd.grad(
            values, leaves, grad_outputs=one_value_each, is_grads_batched=True
        )
        bound = torch.zeros(micro_batch.input_ids.shape, dtype=torch.float64)
        bound[rows, positions] = sum(
            (gradient.abs() * error).flatten(1).sum(1)
            for gradient, error in zip(gradients, errors, strict=True)
        )
        bounds.append(bound)
    return bounds


# ---------------------------------------------------------------- fixtures and tests


@pytest.fixture(scope="module")
def start_dir(tiny_model_dir, tmp_path_factory) -> str:
    """The tiny model with a value head of seeded random weights: a critic's starting
    directory, such as a checkpoint's `critic/` (its values are not all zero)."""
    from safetensors.torch import load_file, save_file

    path = tmp_path_factory.mktemp("critic-start")
    state = load_file(str(Path(tiny_model_dir) / "model.safetensors"))
    hidden = state["model.norm.weight"].numel()
    generator = torch.Generator().manual_seed(5)
    state["value_head.weight"] = torch.randn(1, hidden, generator=generator) / hidden**0.5
    state["value_head.bias"] = torch.tensor([0.1])
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(Path(tiny_model_dir) / "config.json", path / "config.json")
    return str(path)


@pytest.fixture(scope="module")
def runs(rank_runs, start_dir, tiny_model_dir):
    """The 1-rank and the 2-rank run, started together."""
    for mode, world_size in (("single", 1), ("two", 2)):
        rank_runs.start(mode, world_size, start_dir, tiny_model_dir, timeout_s=RUN_TIMEOUT_S)
    return rank_runs


def test_gae_under_megatron_raises_the_critics_explained_variance(runs):
    steps = runs("single")["steps"]
    variance = [step["train/critic_explained_variance"] for step in steps]
    losses = [step["train/critic_value_loss"] for step in steps]
    assert variance[0] == pytest.approx(0.0, abs=1e-6)  # the head starts at zero
    assert min(variance[NUM_STEPS // 2 :]) > max(variance[: NUM_STEPS // 4]), variance
    assert variance[-1] > 0.5 and losses[-1] < 0.2 * losses[0], (variance, losses)
    assert all(step["train/critic_lr"] == pytest.approx(3e-3) for step in steps)
    assert all(step["train/critic_grad_norm"] > 0 for step in steps)


def test_the_critic_at_tp2_with_sequence_parallelism_learns_as_at_tp1_and_keeps_one_head(runs):
    """Through the leader / follower calls of a run. Every TP rank holds the same value
    head after training: bitwise, since they apply the same summed gradient."""
    two = runs("two")
    variance = [step["train/critic_explained_variance"] for step in two["steps"]]
    assert min(variance[NUM_STEPS // 2 :]) > max(variance[: NUM_STEPS // 4]), variance
    assert variance[-1] > 0.5, variance
    other = torch.load(runs.out_dir("two") / "rank1.pt", weights_only=False)["head"]
    assert torch.equal(two["head"], other)
    assert float(two["head"].abs().max()) > 0


def test_a_saved_critic_resumes_with_the_same_values_and_the_same_next_step(runs):
    single = runs("single")
    for saved, resumed in zip(single["values"], single["values_resumed"], strict=True):
        assert torch.equal(saved, resumed)
    # Every figure of the step equal, the wall seconds of its passes (`train/*_s`) aside.
    assert _without_times(single["next_step_resumed"]) == _without_times(single["next_step"])
    assert {k for k in single["next_step"] if k.endswith("_s")} == {
        "train/values_s",
        "train/update_s",
        "train/critic_update_s",
    }
    checkpoint = runs.out_dir("single") / "checkpoint" / "critic"
    assert (checkpoint / "model.safetensors").exists() and (checkpoint / "config.json").exists()


def _without_times(metrics: dict[str, float]) -> dict[str, float]:
    return {key: value for key, value in metrics.items() if not key.endswith("_s")}


def test_a_starting_directory_with_a_value_head_gives_the_same_values_in_every_layout(
    runs, start_dir
):
    """TP 2 (with and without sequence parallelism) against TP 1, and TP 1 against the
    float64 values, within 2E (see the module docstring). PP 2 splits the layers, not a sum:
    every op sees the same operands in the same order, so its values are TP 1's, bitwise."""
    from safetensors.torch import load_file
    from transformers import AutoModel

    micro_batches = fixed_micro_batches()
    bounds = rounding_bound(start_dir, micro_batches)
    tp1 = runs("single")["start_values"]
    two = runs("two")["start_values"]
    body = AutoModel.from_pretrained(start_dir, dtype=torch.float64).eval()
    head = load_file(str(Path(start_dir) / "model.safetensors"))
    for index, micro_batch in enumerate(micro_batches):
        trained = micro_batch.loss_mask > 0
        tolerance = 2 * bounds[index][trained]
        with torch.no_grad():
            hidden = body(
                input_ids=micro_batch.input_ids, attention_mask=micro_batch.attention_mask
            ).last_hidden_state
            scores = hidden @ head["value_head.weight"].double().T + head["value_head.bias"]
        # float64 but for Hugging Face's float32 norms, whose casts E counts
        float64 = torch.cat([torch.zeros(len(scores), 1), scores[:, :-1, 0]], dim=1)[trained]
        reference = tp1[index][trained].double()
        assert float(reference.abs().min()) > 0 and torch.all(tp1[index][~trained] == 0)
        assert torch.all((reference - float64).abs() <= tolerance)
        assert torch.equal(two["pp2"][index], tp1[index])
        for label in ("tp2", "tp2_sp"):
            difference = (two[label][index][trained].double() - reference).abs()
            assert torch.all(difference <= tolerance), (label, float(difference.max()))


def test_streamrl_check_takes_gae_with_megatron_and_splits_the_critics_own_model_like_the_policy():
    from streamrl.check import find_problems

    def layout_problems(policy: str, critic: str, **megatron) -> list[str]:
        problems = find_problems(run_config(policy, critic, **megatron))
        return [p for p in problems if p.startswith(("learner.critic.path", "learner.megatron"))]

    assert layout_problems("random:qwen3-tiny", "random:llama-tiny", tensor_parallel_size=2) == []
    # 24 layers split over 8 stages; the critic's 28 do not.
    problems = layout_problems(
        "random:qwen2-0.5b", "random:qwen2-1.5b", tensor_parallel_size=2, pipeline_parallel_size=8
    )
    assert len(problems) == 1, problems
    assert problems[0].startswith(
        "learner.critic.path = 'random:qwen2-1.5b': learner.megatron.pipeline_parallel_size = 8"
    )
    assert "28 layers" in problems[0]


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/backends: test_critic
    worker_main(single=_worker_single, two=_worker_two)
