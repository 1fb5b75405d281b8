"""What the Megatron tests share: seeded micro-batches, the loss they train with, Hugging
Face's log-probabilities to compare against, and their runs as real gloo ranks.

A test file of this room that runs Megatron runs itself as a script in gloo processes:
`python FILE worker MODE OUT ARGS...`, whose entry is `worker_main`. The test side starts
those processes with `RankRuns` (the `rank_runs` fixture of this room's conftest.py), all of
a module's runs at once, and each test waits for the run it reads. Readiness is the
torch.distributed rendezvous. The processes are forked from a server that has imported torch
and Megatron (`forked_ranks.py`), not started anew, which spares each the imports.

Nothing here imports pytest: `bench/gpu/megatron_check.py` builds its micro-batches with
`seeded_micro_batches` and trains with `nll_loss`, from this file.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from streamrl.backends.base import MicroBatch

REPO_ROOT = Path(__file__).resolve().parents[3]


# ---------------------------------------------------------------- the learner, micro-batches, the loss


def learner_config(
    tp: int = 1, pp: int = 1, *, lr: float = 1e-3, sequence_parallel: bool = False, lora=None
):
    """A Megatron learner at TP `tp` x PP `pp`: Adam at `lr`, the gradient norm clipped at 1,
    Megatron's distributed optimizer but at PP > 1 (where these tests always ran without),
    `lora` (a LoraConfig) when given."""
    from streamrl.config import LearnerConfig, MegatronConfig

    megatron = MegatronConfig(
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        sequence_parallel=sequence_parallel,
        use_distributed_optimizer=pp == 1,
    )
    extra = {} if lora is None else {"lora": lora}
    return LearnerConfig(backend="megatron", lr=lr, grad_clip=1.0, megatron=megatron, **extra)


def seeded_micro_batches(
    lengths: Sequence[Sequence[int]],
    *,
    token_ids: range,
    generator: torch.Generator,
    prompt_tokens: int,
    width: int | None = None,
    advantage: float | None = None,
    random_behaviour: bool = False,
    row_weights: bool = False,
) -> list[MicroBatch]:
    """One right-padded micro-batch per entry of `lengths` (the real tokens of each row), the
    same in every process for the same generator state.

    Token ids are drawn from `token_ids`; each row trains its tokens past the first
    `prompt_tokens`; a micro-batch is `width` wide (default: its longest row). The mini-batch
    totals count every micro-batch's trained tokens and rows. `advantage` fills the
    advantages (None: left unset); `random_behaviour` draws behaviour log-probabilities in
    (-1, 0] on the trained tokens right after each micro-batch's ids (else zeros);
    `row_weights` adds a per-row extra (`extras["row_weight"]`, which `nll_loss` checks
    reached it with its rows)."""
    num_tokens = float(sum(max(length - prompt_tokens, 0) for row in lengths for length in row))
    num_sequences = sum(len(row) for row in lengths)
    out, first = [], 0
    for row_lengths in lengths:
        rows, cols = len(row_lengths), width or max(row_lengths)
        attention = torch.zeros(rows, cols, dtype=torch.int64)
        loss_mask = torch.zeros(rows, cols)
        for row, length in enumerate(row_lengths):
            attention[row, :length] = 1
            loss_mask[row, prompt_tokens:length] = 1.0
        low, high = token_ids.start, token_ids.stop
        input_ids = torch.randint(low, high, (rows, cols), generator=generator) * attention
        behaviour = torch.zeros(rows, cols)
        if random_behaviour:
            behaviour = -torch.rand(rows, cols, generator=generator) * loss_mask
        out.append(
            MicroBatch(
                input_ids=input_ids,
                attention_mask=attention,
                loss_mask=loss_mask,
                behaviour_logprobs=behaviour,
                sample_indices=list(range(first, first + rows)),
                advantages=None if advantage is None else torch.full((rows, cols), advantage),
                num_tokens_in_mini_batch=num_tokens,
                num_sequences_in_mini_batch=num_sequences,
                extras={"row_weight": torch.arange(rows, dtype=torch.float32)}
                if row_weights
                else {},
            )
        )
        first += rows
    return out


def fixed_micro_batches(vocab_size: int) -> list[MicroBatch]:
    """Two right-padded micro-batches (4 + 3 rows, 16 and 12 tokens wide, trained past a
    3-token prompt, advantages 1, per-row weights), the same in every process."""
    return seeded_micro_batches(
        [[16, 11, 7, 14], [12, 5, 9]], token_ids=range(vocab_size),
        generator=torch.Generator().manual_seed(1234), prompt_tokens=3, advantage=1.0,
        row_weights=True,
    )  # fmt: skip


def nll_loss(micro_batch, logprobs, entropy):
    """Token-mean negative log-likelihood of the trained tokens (a loss that must go down),
    and the token-mean entropy when the backend computed it. Asserts that the micro-batch's
    per-row extra came with its rows (every rank, every split)."""
    from streamrl.algorithms import aggregate

    def token_mean(values: torch.Tensor) -> torch.Tensor:
        return aggregate(
            values,
            micro_batch.loss_mask,
            "token_mean",
            num_tokens=micro_batch.num_tokens_in_mini_batch,
            num_sequences=micro_batch.num_sequences_in_mini_batch,
        )

    loss = token_mean(-logprobs)
    assert micro_batch.extras["row_weight"].shape[0] == micro_batch.input_ids.shape[0]
    metrics = {"nll": loss.detach()}
    if entropy is not None:
        metrics["entropy"] = token_mean(entropy).detach()
    return loss, metrics


def hf_token_logprobs(model, micro_batch) -> torch.Tensor:
    """A Hugging Face model's log-probability of every token, 0 at position 0 and padding."""
    from streamrl.algorithms import logprobs_from_logits

    with torch.no_grad():
        logits = model(micro_batch.input_ids, attention_mask=micro_batch.attention_mask).logits
    return logprobs_from_logits(logits, micro_batch.input_ids) * micro_batch.attention_mask


# ---------------------------------------------------------------- runs as gloo ranks


def worker_main(**workers: Callable[..., None]) -> None:
    """The entry of a test file run as a script, `python FILE worker MODE OUT ARGS...`:
    joins the rendezvous its test started (gloo, one thread), runs
    `workers[MODE](Path(OUT), *ARGS)` and leaves."""
    import warnings

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    from streamrl.backends.rendezvous import init_distributed, shutdown

    command, mode, out, *args = sys.argv[1:]
    assert command == "worker", sys.argv
    init_distributed(device="cpu", timeout_s=120)
    workers[mode](Path(out), *args)
    shutdown()


class RankRuns:
    """Runs of one test file as a script (`worker_main`), each in its own folder under `root`;
    `runs(mode)` waits for a run and loads what its rank 0 saved at OUT."""

    def __init__(self, script: str | Path, root: Path) -> None:
        self.script = Path(script)
        self.root = root
        self._started: dict = {}
        self._loaded: dict[str, dict] = {}

    def start(self, mode: str, world_size: int, *args: str, timeout_s: float) -> None:
        """Start `world_size` ranks of `python SCRIPT worker MODE OUT ARGS...`, each forked
        from a server that imported torch and Megatron once (`forked_ranks`); this checkout's
        streamrl leads their sys.path (after the script's own folder)."""
        from forked_ranks import spawn

        from streamrl.backends.rendezvous import start_ranks

        out = self.out_dir(mode) / "result.pt"
        out.parent.mkdir(parents=True)
        argv = [sys.executable, str(self.script), "worker", mode, str(out), *args]
        env = {"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "PYTHONPATH": str(REPO_ROOT)}
        group = start_ranks(
            argv, world_size=world_size, log_dir=out.parent, env=env, spawn_fn=spawn
        )
        self._started[mode] = (group, out, timeout_s)

    def __call__(self, mode: str) -> dict:
        if mode not in self._loaded:
            group, out, timeout_s = self._started[mode]
            group.wait(timeout_s)
            self._loaded[mode] = torch.load(out, weights_only=False)
        return self._loaded[mode]

    def out_dir(self, mode: str) -> Path:
        """The run's folder: its OUT, its logs, what its ranks save beside OUT."""
        return self.root / mode

    def stop(self) -> None:
        for group, _, _ in self._started.values():
            group.stop()
