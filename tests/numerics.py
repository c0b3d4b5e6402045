"""The error analysis behind the suite's numerical tolerances.

Most numerical tests compare two fp32 computations of the same mathematics done in different orders: the
engine's fused, windowed, paged kernels against peft's and transformers' full-sequence ones. torch picks
its kernels per machine (AVX-512, AVX2 or plain: `ATEN_CPU_CAPABILITY`) and splits reductions over its
threads, so a tolerance must hold for any summation order, not for the one this machine happens to use
(`make test-kernels` reruns these tests under every kernel set and with 1 and 2 threads). Each bound here is
fp32's unit roundoff `U32` times a condition number of the compared quantity, computed from the values the
test compares; each test names the bound it uses in a one-line comment.

The model of one side's rounding:
* one token's log-probability (a log-softmax entry: max-subtracted exp, a sum over the vocabulary, a log)
  is within `TERM_ULPS` u of |log p| of the exact value for the same logits; the forward's own rounding of
  the logits is of that order for the tiny models (2-4 layers, width <= 256) and is covered below;
* a sum of n such terms in any order adds at most (n - 1) u of the sum of their magnitudes (recursive
  summation, Higham, "Accuracy and Stability of Numerical Algorithms", eq. 4.4), a worst case that random
  rounding reaches only as sqrt(n) u, which leaves room for the forward's rounding of each term;
* two sides each within that bound differ by at most twice it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

U32 = 2.0**-24  # float32's unit roundoff
U64 = 2.0**-53  # float64's
TERM_ULPS = 4  # one log-softmax entry: exp and log 1 u each, the max-subtracted sum over V about 2 u


def sum_rel(n_terms: int, sides: int = 2) -> float:
    """Relative error bound of a sum of `n_terms` same-sign fp32 log-prob terms, between `sides` fp32
    computations (2: engine and reference; 1: one fp32 side against a float64 reference)."""
    return sides * (TERM_ULPS + max(n_terms - 1, 0)) * U32


def sum_bound(magnitudes: Iterable[float], sides: int = 2) -> float:
    """Absolute error bound of a sum of terms of any sign, each an fp32 product of a few factors one of
    which is a token's log-prob: `sum_rel(n) * sum |term|` (cancellation makes the relative error of the
    result unbounded, so the bound is on the magnitudes, not on the result)."""
    values = [abs(m) for m in magnitudes]
    return sum_rel(len(values), sides) * sum(values)


def sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))


def dpo_loss_bound(pairs: Sequence[tuple[Sequence[float], Sequence[int]]], beta: float, batch: int,
                   sides: int = 2) -> float:
    """Absolute error bound of TRL's sigmoid DPO loss over `batch` pairs, from its log-prob sums.

    `pairs`: per pair, its four sums (chosen, rejected, and their references) and each sum's token count.
    L = -(1/B) sum_i log sigmoid(z_i), z_i = beta ((C - C_ref) - (R - R_ref)), so
    |dL| <= (beta / B) sum_i sigmoid(-z_i) sum_k |S_ik| sum_rel(n_ik): a difference of sums of hundreds
    carries their rounding into a loss of order one (the condition number is in the hundreds).
    """
    total = 0.0
    for sums, counts in pairs:
        chosen, rejected, ref_chosen, ref_rejected = sums
        z = beta * ((chosen - ref_chosen) - (rejected - ref_rejected))
        rounding = sum(abs(s) * sum_rel(n, sides) for s, n in zip(sums, counts))
        total += beta / batch * sigmoid(-z) * rounding
    return total


def dpo_margin_bound(sums: Sequence[float], counts: Sequence[int], beta: float, sides: int = 2) -> float:
    """Absolute error bound of one pair's margin z = beta ((C - C_ref) - (R - R_ref))."""
    return beta * sum(abs(s) * sum_rel(n, sides) for s, n in zip(sums, counts))


# A LoRA gradient entry (or a weight after a few Adam steps) against the reference, relative to its tensor's
# largest: each entry is a reduction over K <= tokens x width = 64 x 256 = 2^14 products of the tensor's
# scale, through a backward of <= 4 layers; random rounding leaves 2 sqrt(K) u = 1.5e-5 per reduction, 6e-5
# over the 4 layers' chained reductions (the worst case 2 K u = 2e-3 is never approached).
GRAD_REL_ERR = 1e-4


def assert_adam_weights_close(mine: dict[str, Any], theirs: dict[str, Any], learning_rate: float, steps: int,
                              max_noisy: float = 0.02) -> None:
    """Two adapters trained by the same Adam steps from gradients that differ by fp32 rounding.

    Adam's step lr m / (sqrt(v) + eps) is scale-free: where a gradient element is large against the
    rounding (GRAD_REL_ERR of its tensor's largest), the two steps agree to its relative error and the
    weights to rtol 1e-3 (atol 1e-5 where a weight crosses zero); where it is at the rounding's level, its
    sign, and so the step, may differ by up to 2 lr each step. So: all but `max_noisy` of the elements
    within rtol 1e-3, and every element within 2 lr x steps (a wrong gradient moves whole tensors by that).
    """
    bound = 2 * learning_rate * steps
    noisy = total = 0
    for key, a in mine.items():
        b = theirs[key]
        diff = (a - b).abs()
        assert float(diff.max()) <= bound, f"{key}: {float(diff.max()):.2e} past Adam's bound {bound:.1e}"
        noisy += int((diff > 1e-5 + 1e-3 * b.abs()).sum())
        total += a.numel()
    assert noisy <= max_noisy * total, f"{noisy} of {total} elements past rtol 1e-3: more than rounding"
