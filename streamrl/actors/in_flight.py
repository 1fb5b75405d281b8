"""The groups a rollout worker has in flight: what a checkpoint's cut reads and a restart
continues.

Collecting them (the trainer's `CollectInFlight(step)`, sent when it writes a checkpoint)
closes the worker's `Hold`, aborts every engine request (each comes back with its partial output),
waits until every call has parked, and reports each group's samples as `PartialGroup`s:
their tokens, behaviour logprobs and versions so far. Then the hold opens and every call
goes on from its tokens: generation stops for the collection alone.

On resume the trainer hands the saved groups to the new rollout process, which starts
them before new prompts: each sample continues from its tokens on the restored engines
(`resume_completion`); a finished one is kept as it was. A generate function that is not
one model turn per sample (multi-turn episodes keep state of their own) cannot be
continued from tokens: its groups are generated again from their prompts, and counted.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import anyio

from streamrl.agents.api import Completion, GenerateContext, Hold
from streamrl.fleet.engine_set import EngineSetError
from streamrl.types import FinishReason, PartialGroup, PartialSample

log = logging.getLogger(__name__)

COLLECT_TIMEOUT_S = 60.0
"""A collection whose calls have not all parked by then reports no partial samples (their
groups are then generated again on resume)."""

REABORT_S = 0.1
"""While calls are still out, the engines' requests are aborted again this often: a call
that had passed the hold when it closed reaches its engine after the abort, and would
otherwise decode to the end of its budget (2.8 s of a 1.5B checkpoint's cut on the H200,
with responses of 1,024 tokens)."""


@dataclass
class _GroupState:
    contexts: dict[int | None, GenerateContext] = field(default_factory=dict)
    """Sample index -> its context; None -> one context making the whole group (`for_group`)."""


class InFlight:
    """The worker's groups in flight, by prompt seq (see the module docstring)."""

    def __init__(self, *, resumable: bool) -> None:
        self.resumable = resumable
        """Whether the generate function makes each sample as one model turn of the prompt."""
        self.hold = Hold()
        self._groups: dict[int, _GroupState] = {}

    @property
    def seqs(self) -> set[int]:
        return set(self._groups)

    def started(self, seq: int) -> None:
        self._groups[seq] = _GroupState()

    def add_context(self, seq: int, index: int | None, context: GenerateContext) -> None:
        if seq in self._groups:
            self._groups[seq].contexts[index] = context

    def sent(self, seq: int) -> None:
        self._groups.pop(seq, None)

    async def collect(self, engines, num_samples: int) -> tuple[list[PartialGroup], dict]:
        """Stop every call at its tokens, read them, let them go on. Returns the groups and
        what it cost (`seconds`, `complete`: every call parked in time, `aborts`: how many
        times the engines' requests were aborted, `REABORT_S` apart)."""
        started = time.perf_counter()
        aborts = 0
        self.hold.close()
        try:
            with anyio.move_on_after(COLLECT_TIMEOUT_S) as timeout:
                while aborts == 0 or not self.hold.all_parked:
                    await self._abort(engines, first=aborts == 0)
                    aborts += 1
                    with anyio.move_on_after(REABORT_S):
                        await self.hold.wait_parked()
            complete = not timeout.cancelled_caught
            groups = [
                PartialGroup(prompt_seq=seq, samples=self._samples(state, num_samples))
                if complete and self.resumable
                else PartialGroup(prompt_seq=seq)
                for seq, state in sorted(self._groups.items())
            ]
        finally:
            self.hold.release()
        return groups, {
            "seconds": time.perf_counter() - started,
            "complete": complete,
            "aborts": aborts,
        }

    @staticmethod
    async def _abort(engines, *, first: bool) -> None:
        try:
            await engines.abort_all()
        except EngineSetError as exc:
            # An engine that is down or still loading holds no call to stop: the calls it
            # had fail, are retried, and park at the closed hold too.
            log.log(
                logging.WARNING if first else logging.DEBUG,
                "collecting the groups in flight: %s; waiting for their calls to park",
                exc,
            )

    def _samples(self, state: _GroupState, num_samples: int) -> list[PartialSample]:
        if None in state.contexts:  # one context for the group: its completions in order
            completions = dict(enumerate(state.contexts[None].completions[:num_samples]))
        else:
            completions = {
                index: context.completions[0]
                for index, context in state.contexts.items()
                if context.completions
            }
        return [
            PartialSample(
                index=index,
                output_ids=list(c.output_ids),
                logprobs=list(c.logprobs),
                versions=list(c.versions),
                text=c.text,
                finish_reason=str(c.finish_reason) if c.is_finished else "",
                versions_exact=c.versions_exact,
            )
            for index, c in sorted(completions.items())
        ]


def restored_completion(sample: PartialSample) -> Completion:
    """A saved sample as the completion it was."""
    return Completion(
        output_ids=list(sample.output_ids),
        logprobs=list(sample.logprobs),
        versions=list(sample.versions),
        text=sample.text,
        finish_reason=FinishReason(sample.finish_reason or "stop"),
        is_finished=bool(sample.finish_reason),
        versions_exact=sample.versions_exact,
        num_engine_calls=1 if sample.output_ids else 0,
    )


async def resume_completion(
    context: GenerateContext, sample: PartialSample, input_ids: list[int]
) -> Completion:
    """Continue a saved sample from its tokens (a finished one comes back as it was)."""
    completion = restored_completion(sample)
    context.completions.append(completion)
    if completion.is_finished:
        return completion
    budget = int(context.sampling_params.get("max_new_tokens", 128))
    return await context.continue_completion(
        completion, input_ids, budget, dict(context.sampling_params)
    )
