"""Staleness of long episodes, turn by turn (`buffer.staleness_rule`).

An episode of many model turns lives through several weight versions: its first turn
was sampled by an older policy than its last. Two rules decide whether it is trained:

- `episode` (the single-turn rule applied to the whole episode): staleness is measured
  from the oldest trained token, so an episode that spans more than eta + 1 versions
  is always evicted.
- `per_turn` (the default of a run): the bound applies to each turn at the time the
  episode moved past it, and to the last turn at training time. With m_t the oldest
  version among turn t's trained tokens (t = 1..T) and v the learner's version:

      m_{t+1} - m_t <= eta   for every t < T   (checked once, when the group arrives)
      v - m_T       <= eta                     (checked when batches are taken)

  So each turn was at most eta versions old when the next one started, and the last
  turn is as fresh as a single-turn sample must be. The early turns' tokens can be
  older than eta when trained; every token keeps its own behaviour logprob and version,
  and the off-policy correction (decoupled PPO's pi_prox / pi_behav, or TIS) reweights
  each against the policy that sampled it. `buffer.max_episode_staleness` (> 0) bounds
  the oldest token's staleness as well, for those who want a hard limit.

For a sample of one turn (every single-turn sample; `Sample.turn_starts` empty or
`[0]`) both rules are the same check, `v - oldest <= eta`, so the single-turn guarantee
is untouched. Admission still bounds when episodes start. Metrics: the per-turn
staleness of what is trained (`turn_staleness`), and how many trained groups were older
than eta at their oldest token (`past_bound`): this is never silent.
"""

from __future__ import annotations

import itertools
from typing import Literal

import numpy as np

from streamrl.types import Group, Sample

StalenessRule = Literal["episode", "per_turn"]


def turn_min_versions(sample: Sample) -> list[int]:
    """Oldest trained-token version of each model turn with trained tokens, in order."""
    trained = sample.loss_mask.astype(bool)
    starts = [s for s in sample.turn_starts if 0 <= s < len(sample.response_ids)] or [0]
    bounds = [*starts, len(sample.response_ids)]
    out = []
    for start, end in itertools.pairwise(bounds):
        versions = sample.versions[start:end][trained[start:end]]
        if len(versions):
            out.append(int(versions.min()))
    return out


def bound_version(group: Group, rule: StalenessRule) -> int | None:
    """The version the staleness bound is measured from: the oldest trained token
    (`episode`), or the oldest token of each sample's last turn, over samples
    (`per_turn`). None when nothing is trained."""
    if rule == "episode":
        return group.oldest_version
    lasts = [turns[-1] for s in group.samples if (turns := turn_min_versions(s))]
    return min(lasts) if lasts else None


def max_turn_gap(group: Group) -> int:
    """Largest m_{t+1} - m_t over consecutive turns of any sample (0 for single turns)."""
    gaps = [
        later - earlier
        for sample in group.samples
        for earlier, later in itertools.pairwise(turn_min_versions(sample))
    ]
    return max(gaps, default=0)


def turn_staleness(group: Group, version: int) -> list[int]:
    """`version - m_t` for every turn of every sample of the group."""
    return [version - m for s in group.samples for m in turn_min_versions(s)]


def step_metrics(groups: list[Group], version: int, max_staleness: int) -> dict[str, float]:
    """Per-turn staleness of a trained batch (the learner logs these with each step)."""
    per_turn = [x for g in groups for x in turn_staleness(g, version)]
    last = [
        version - turns[-1] for g in groups for s in g.samples if (turns := turn_min_versions(s))
    ]
    if not per_turn:
        return {}
    return {
        "staleness/turn_mean": float(np.mean(per_turn)),
        "staleness/turn_max": int(max(per_turn)),
        "staleness/last_turn_max": int(max(last)),
        "staleness/turn_gap_max": max(max_turn_gap(g) for g in groups),
        "staleness/groups_past_bound": sum(g.staleness(version) > max_staleness for g in groups),
    }
