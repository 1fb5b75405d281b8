"""Advantage estimators and policy losses: pure functions on torch tensors.

Layout (see `streamrl.backends.base`): per-token tensors are `[B, T]` and
aligned with `input_ids`, position t holding data about token t; `loss_mask`
is 1 on trained (model-produced) tokens; the samples of one group are
consecutive rows. The training loop composes these functions: advantages once
per step (`token_advantages`), then per micro-batch `policy_loss` (plus
`kl_penalty` and entropy) reduced with `aggregate` against the mini-batch
totals. With a critic, `gae_advantages` gives the advantages and value
targets, and `value_loss` is reduced the same way.
"""

from streamrl.algorithms.advantages import (
    ADVANTAGE_ESTIMATORS,
    GROUP_ESTIMATORS,
    group_advantages,
    token_advantages,
)
from streamrl.algorithms.critic import explained_variance, gae_advantages, value_loss
from streamrl.algorithms.logits import (
    entropy_from_logits,
    entropy_of_rows,
    logprobs_from_logits,
    logprobs_of_rows,
)
from streamrl.algorithms.losses import (
    AGGREGATIONS,
    CORRECTIONS,
    KL_KINDS,
    LOG_RATIO_BOUND,
    POLICY_LOSSES,
    aggregate,
    kl_penalty,
    policy_loss,
)
from streamrl.algorithms.masks import masked_mean, masked_whiten

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AGGREGATIONS",
    "CORRECTIONS",
    "GROUP_ESTIMATORS",
    "KL_KINDS",
    "LOG_RATIO_BOUND",
    "POLICY_LOSSES",
    "aggregate",
    "entropy_from_logits",
    "entropy_of_rows",
    "explained_variance",
    "gae_advantages",
    "group_advantages",
    "kl_penalty",
    "logprobs_from_logits",
    "logprobs_of_rows",
    "masked_mean",
    "masked_whiten",
    "policy_loss",
    "token_advantages",
    "value_loss",
]
