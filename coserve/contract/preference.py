"""DPO's loss of preference pairs from their summed log-probs, and what TRL logs of it.

For a pair with summed completion log-probs pi_c, pi_r under the adapter and ref_c, ref_r with it off
(the base model: the reference costs no second copy of the weights), TRL's sigmoid loss is

    z = beta * ((pi_c - ref_c) - (pi_r - ref_r)),   loss = -log sigmoid(z),

averaged over the batch's pairs, with d(loss)/d(pi_c) = -beta * sigmoid(-z) / pairs and
d(loss)/d(pi_r) = +beta * sigmoid(-z) / pairs. The rewards TRL logs are beta * (pi - ref) of each side
(`rewards/chosen`, `rewards/rejected`), their difference (`rewards/margins`) and whether the chosen one
is higher (`rewards/accuracies`).

Pure Python floats, shared by the engine's trainer (the sums come from the windows of `SequenceLogprob`
sequences; the coefficients go back as `SequenceState.scale_gradient`) and the scheduler (a DPO job's
validation metrics, from the sums its windows report).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


def _log_sigmoid(z: float) -> float:
    """log(1 / (1 + e^-z)) without overflow for large |z|."""
    return -math.log1p(math.exp(-z)) if z >= 0 else z - math.log1p(math.exp(z))


def _sigmoid(z: float) -> float:
    return 1.0 / (1.0 + math.exp(-z)) if z >= 0 else math.exp(z) / (1.0 + math.exp(z))


@dataclass(frozen=True, slots=True)
class PairLogprobs:
    """Summed completion log-probs of one pair: under the adapter (policy) and with it off (reference)."""

    policy_chosen: float
    policy_rejected: float
    reference_chosen: float
    reference_rejected: float


@dataclass(frozen=True, slots=True)
class DpoPair:
    """One pair's loss, the coefficients of its two sequences' gradients, and its rewards."""

    loss: float  # -log sigmoid(z), not divided by the batch's pairs
    chosen_coefficient: float  # d(batch loss)/d(pi_c)
    rejected_coefficient: float  # d(batch loss)/d(pi_r)
    reward_chosen: float  # beta * (pi_c - ref_c)
    reward_rejected: float  # beta * (pi_r - ref_r)

    @property
    def margin(self) -> float:
        return self.reward_chosen - self.reward_rejected

    @property
    def correct(self) -> bool:
        """TRL's `rewards/accuracies`: the chosen answer's reward is the higher (a tie is not)."""
        return self.reward_chosen > self.reward_rejected


def dpo_pair(logprobs: PairLogprobs, beta: float, pairs_in_batch: int) -> DpoPair:
    """The sigmoid DPO loss of one pair, for a batch of `pairs_in_batch` pairs (the batch mean)."""
    reward_chosen = beta * (logprobs.policy_chosen - logprobs.reference_chosen)
    reward_rejected = beta * (logprobs.policy_rejected - logprobs.reference_rejected)
    z = reward_chosen - reward_rejected
    push = beta * _sigmoid(-z) / pairs_in_batch
    return DpoPair(loss=-_log_sigmoid(z), chosen_coefficient=-push, rejected_coefficient=push,
                   reward_chosen=reward_chosen, reward_rejected=reward_rejected)


@dataclass(frozen=True, slots=True)
class DpoMetrics:
    """A batch's DPO metrics, with TRL's names in `as_dict`."""

    loss: float
    reward_chosen: float
    reward_rejected: float
    reward_accuracy: float
    reward_margin: float
    logps_chosen: float
    logps_rejected: float

    def as_dict(self) -> dict[str, float]:
        return {"train_loss": self.loss, "rewards/chosen": self.reward_chosen,
                "rewards/rejected": self.reward_rejected, "rewards/accuracies": self.reward_accuracy,
                "rewards/margins": self.reward_margin, "logps/chosen": self.logps_chosen,
                "logps/rejected": self.logps_rejected}


def dpo_metrics(pairs: list[DpoPair], logprobs: list[PairLogprobs]) -> DpoMetrics:
    """The batch means of the pairs' loss, rewards, accuracy, margin and policy log-probs."""
    n = len(pairs)
    if n == 0 or n != len(logprobs):
        raise ValueError(f"need one log-prob record per pair, got {n} pairs and {len(logprobs)}")
    return DpoMetrics(
        loss=sum(p.loss for p in pairs) / n,
        reward_chosen=sum(p.reward_chosen for p in pairs) / n,
        reward_rejected=sum(p.reward_rejected for p in pairs) / n,
        reward_accuracy=sum(p.correct for p in pairs) / n,
        reward_margin=sum(p.margin for p in pairs) / n,
        logps_chosen=sum(lp.policy_chosen for lp in logprobs) / n,
        logps_rejected=sum(lp.policy_rejected for lp in logprobs) / n)


def validation_metrics(records: list[PairLogprobs], beta: float) -> dict[str, float]:
    """Validation pairs' DPO loss and rewards from their four summed log-probs, named `valid_loss`,
    `valid_rewards/chosen`, ... (the training metrics' names with `valid_` in front)."""
    pairs = [dpo_pair(r, beta, len(records)) for r in records]
    metrics = dpo_metrics(pairs, records).as_dict()
    return {"valid_loss": metrics.pop("train_loss"), **{f"valid_{k}": v for k, v in metrics.items()}}
