"""Which loss a training sequence is trained with, and the per-token inputs it needs (torch-free).

The losses are Tinker's (https://tinker-docs.thinkingmachines.ai/losses) plus DPO's, all written over the
log-probability l_t the model gives token t (the target of position t - 1):

* `cross_entropy`: sum_t -w_t * l_t (w_t = `weights`, 1 on trained tokens for supervised jobs);
* `importance_sampling`: sum_t -exp(l_t - q_t) * A_t (q_t = `sampling_logprobs`, A_t = `advantages`);
* `ppo`: sum_t -min(r_t * A_t, clip(r_t, clip_low, clip_high) * A_t), r_t = exp(l_t - q_t);
* `cispo`: sum_t -stop_grad(clip(r_t, clip_low, clip_high)) * l_t * A_t;
* `dpo`: -log sigmoid(beta * ((pi_c - ref_c) - (pi_r - ref_r))) per preference pair, pi the summed
  log-probs of the chosen (c) and rejected (r) answer under the adapter, ref the same with it off.

The per-token losses are sums over a sequence's tokens, as Tinker's are; a supervised job divides by the
batch's trained tokens (its `loss_normalizer`) to train on the batch mean. Token arrays are aligned with
the sequence's token ids: entry t belongs to token t (entry 0 is never used: token 0 has no position
predicting it).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from coserve.contract.training_settings import SettingsError

DEFAULT_CLIP_LOW = 0.8  # Tinker's thresholds on the probability ratio (epsilon 0.2 each way)
DEFAULT_CLIP_HIGH = 1.2
DEFAULT_BETA = 0.1  # DPO's beta when "auto" (TRL's and the DPO paper's default)
MAX_BETA = 10.0


class LossKind(str, enum.Enum):
    CROSS_ENTROPY = "cross_entropy"
    IMPORTANCE_SAMPLING = "importance_sampling"
    PPO = "ppo"
    CISPO = "cispo"
    DPO = "dpo"

    @property
    def needs_sampling_logprobs(self) -> bool:
        return self in (LossKind.IMPORTANCE_SAMPLING, LossKind.PPO, LossKind.CISPO)


@dataclass(frozen=True, slots=True)
class LossSpec:
    """A loss and its settings (`clip_*`: ppo and cispo; `beta`: dpo).

    Raises:
        SettingsError: clip thresholds that are not 0 <= clip_low <= 1 <= clip_high, or a beta that is
            not in (0, MAX_BETA]; `param` names it.
    """

    kind: LossKind = LossKind.CROSS_ENTROPY
    clip_low: float = DEFAULT_CLIP_LOW
    clip_high: float = DEFAULT_CLIP_HIGH
    beta: float = DEFAULT_BETA

    def __post_init__(self) -> None:
        if not (math.isfinite(self.clip_low) and math.isfinite(self.clip_high)
                and 0.0 <= self.clip_low <= 1.0 <= self.clip_high):
            raise SettingsError("clip_low_threshold", f"the clip thresholds must satisfy 0 <= low <= 1 "
                                f"<= high, got {self.clip_low} and {self.clip_high}")
        if not (math.isfinite(self.beta) and 0.0 < self.beta <= MAX_BETA):
            raise SettingsError("beta", f"beta must be a number in (0, {MAX_BETA:g}], got {self.beta!r}")


@dataclass(slots=True)
class TokenInputs:
    """The per-token inputs of one sequence's loss, each aligned with its token ids (None: not given).

    `weights` defaults to the sequence's trained mask (1 on trained tokens); the policy-gradient losses
    need `sampling_logprobs` and `advantages`.
    """

    weights: list[float] | None = None
    sampling_logprobs: list[float] | None = None
    advantages: list[float] | None = None

    def check(self, kind: LossKind, length: int) -> None:
        """Raises SettingsError when `kind` lacks an input it needs or an array is not `length` long."""
        for name in ("weights", "sampling_logprobs", "advantages"):
            values = getattr(self, name)
            if values is not None and len(values) != length:
                raise SettingsError(name, f"{name} has {len(values)} entries for {length} tokens")
            if values is not None and not all(math.isfinite(v) for v in values):
                raise SettingsError(name, f"{name} holds a value that is not a finite number")
        if kind.needs_sampling_logprobs:
            for name in ("sampling_logprobs", "advantages"):
                if getattr(self, name) is None:
                    raise SettingsError(name, f"loss '{kind.value}' needs '{name}'")
