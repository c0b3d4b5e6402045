"""The loss layer: what a loss makes of the log-probs of a window's trained tokens.

Every loss coserve trains with is a function of the log-probabilities l_t of the sequence's target
tokens (`coserve.contract.loss_spec` has the formulas). A window's forward gives l_t and, from the
chunked cross-entropy, d(l_t)/d(hidden) = -(softmax @ W - W[target]) for each trained position, so a
loss only has to say, per token, its value and d(loss)/d(l_t): the window's output gradient is that
coefficient times d(l_t)/d(hidden). The windowed backward is the same for every loss, and so exact for
every loss (`coserve.trainer.windowed`).

Per-token losses (cross-entropy, importance sampling, PPO, CISPO) know their coefficient in the window.
A loss over whole-sequence sums (DPO) does not: its sequences use `SequenceLogprob` (coefficient 1, so
the stored gradient is that of the sequence's summed log-prob), and once every forward of the loss is
done, `SequenceState.scale_gradient` multiplies it by d(loss)/d(sum), before the first backward tasklet.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from coserve.contract.loss_spec import LossKind, LossSpec, TokenInputs


@dataclass(slots=True)
class TokenTerms:
    """Per trained position of a window: the loss's term and d(term)/d(log-prob)."""

    loss: torch.Tensor  # [n] fp32
    dlogprob: torch.Tensor  # [n] fp32


class TokenLoss(Protocol):
    def terms(self, tokens: torch.Tensor, logprobs: torch.Tensor) -> TokenTerms:
        """The terms of target tokens `tokens` (indices into the sequence) given their log-probs."""


@dataclass(slots=True)
class CrossEntropy:
    """sum_t -w_t * l_t; `weights` None: weight 1 (the trained mask already picked the tokens)."""

    weights: torch.Tensor | None = None  # [L] fp32, aligned with the token ids

    def terms(self, tokens: torch.Tensor, logprobs: torch.Tensor) -> TokenTerms:
        w = torch.ones_like(logprobs) if self.weights is None else self.weights[tokens]
        return TokenTerms(-w * logprobs, -w)


@dataclass(slots=True)
class ImportanceSampling:
    """sum_t -exp(l_t - q_t) * A_t: REINFORCE with an importance weight for the sampler's policy q."""

    sampling_logprobs: torch.Tensor  # [L] fp32
    advantages: torch.Tensor  # [L] fp32

    def terms(self, tokens: torch.Tensor, logprobs: torch.Tensor) -> TokenTerms:
        ratio = torch.exp(logprobs - self.sampling_logprobs[tokens])
        objective = ratio * self.advantages[tokens]
        return TokenTerms(-objective, -objective)  # d(ratio)/d(l) = ratio


@dataclass(slots=True)
class Ppo:
    """sum_t -min(r_t * A_t, clip(r_t, low, high) * A_t): no gradient where the clipped term is the min
    and the ratio is outside the clip range (the update would leave the trust region)."""

    sampling_logprobs: torch.Tensor
    advantages: torch.Tensor
    clip_low: float
    clip_high: float

    def terms(self, tokens: torch.Tensor, logprobs: torch.Tensor) -> TokenTerms:
        ratio = torch.exp(logprobs - self.sampling_logprobs[tokens])
        advantages = self.advantages[tokens]
        unclipped = ratio * advantages
        clipped = ratio.clamp(self.clip_low, self.clip_high) * advantages
        use_unclipped = unclipped <= clipped
        objective = torch.where(use_unclipped, unclipped, clipped)
        # Inside the clip range both sides are equal (so `use_unclipped`); outside it the clipped side
        # is a constant.
        grad = torch.where(use_unclipped, unclipped, torch.zeros_like(unclipped))
        return TokenTerms(-objective, -grad)


@dataclass(slots=True)
class Cispo:
    """sum_t -stop_grad(clip(r_t, low, high)) * A_t * l_t (MiniMax-M1's CISPO, as Tinker has it)."""

    sampling_logprobs: torch.Tensor
    advantages: torch.Tensor
    clip_low: float
    clip_high: float

    def terms(self, tokens: torch.Tensor, logprobs: torch.Tensor) -> TokenTerms:
        ratio = torch.exp(logprobs - self.sampling_logprobs[tokens]).clamp(self.clip_low, self.clip_high)
        coefficient = -ratio * self.advantages[tokens]
        return TokenTerms(coefficient * logprobs, coefficient)


@dataclass(slots=True)
class SequenceLogprob:
    """The summed log-prob itself (coefficient 1): for a loss over sequence sums (see the docstring)."""

    def terms(self, tokens: torch.Tensor, logprobs: torch.Tensor) -> TokenTerms:
        return TokenTerms(logprobs, torch.ones_like(logprobs))


def token_loss(spec: LossSpec, inputs: TokenInputs, device: torch.device) -> TokenLoss:
    """The token loss of `spec` over one sequence's `inputs` (checked with `TokenInputs.check`)."""

    def tensor(values: list[float] | None) -> torch.Tensor:
        assert values is not None  # `TokenInputs.check` refuses a missing input
        return torch.tensor(values, dtype=torch.float32, device=device)

    weights = None if inputs.weights is None else tensor(inputs.weights)
    if spec.kind == LossKind.CROSS_ENTROPY:
        return CrossEntropy(weights)
    if spec.kind == LossKind.DPO:
        return SequenceLogprob()
    sampling, advantages = tensor(inputs.sampling_logprobs), tensor(inputs.advantages)
    if spec.kind == LossKind.IMPORTANCE_SAMPLING:
        return ImportanceSampling(sampling, advantages)
    if spec.kind == LossKind.PPO:
        return Ppo(sampling, advantages, spec.clip_low, spec.clip_high)
    return Cispo(sampling, advantages, spec.clip_low, spec.clip_high)
