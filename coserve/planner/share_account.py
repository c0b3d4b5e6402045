"""Fine-tuning's account of an engine's time, for its minimum share (`liveness`): what it is owed.

Each iteration planned while a job is runnable is recorded with what the latency model predicts for it,
and how the model divides it: fine-tuning's part of the whole (all of it in an iteration without
inference), and the forward windows' part of the fused forward. Once its result comes, fine-tuning's
time is what the engine measured for its backward tasklets, optimizer steps and saves
(`StepTimings.backward_s`, after the fused forward) plus the windows' part of the rest: the model only
divides the one fused forward, which has no separate clocks. A result without that split (a simulator,
a test) is divided by the model's part of the whole, and one that carries no time counts its predicted
time.

The account is a debt: each iteration adds `share` x its time and takes away fine-tuning's part, so
over any stretch of iterations fine-tuning's time is `share` of the whole, less the debt (what the floor
has not paid yet), plus the surplus (a piece bigger than what was owed). Both are bounded: the debt by
what one `window_s` of time would owe (a job that could not run for a minute is not owed a minute), the
surplus by that or the last piece, whichever is more (a long stretch of idle engine, where fine-tuning
had whole iterations, is no credit for later). A plan with no runnable job clears it.

How far the measurements are from the model's prices, for fine-tuning and for inference apart
(`finetune_scale`, `inference_scale`: moving averages of measured over predicted), turns the model's
seconds into the machine's: a model that prices fine-tuning pieces 10x too low, or everything 50x too
high, still gets pieces sized right after a few of them. Pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_PENDING = 64  # planned iterations waiting for their result (one or two in flight; a lost engine's never come)
SCALE_SMOOTHING = 0.2  # weight of one measured iteration in the moving averages of measured / predicted
SCALE_LIMITS = (1 / 50, 50.0)  # one iteration's measured / predicted is clipped into this range


@dataclass(frozen=True, slots=True)
class PlannedSplit:
    """How the model divides a planned iteration: its predicted time, fine-tuning's part of it (in [0,
    1]) and the forward windows' part of the fused forward (the time outside backward tasklets)."""

    predicted_s: float
    finetune_part: float
    forward_part: float

    def finetune_s(self, total_s: float, backward_s: float) -> float:
        """Fine-tuning's time in an iteration that took `total_s`, `backward_s` of it after the forward
        (0: the engine did not say)."""
        if self.finetune_part <= 0:
            return 0.0
        if backward_s <= 0 or backward_s > total_s:
            return total_s * self.finetune_part
        return backward_s + (total_s - backward_s) * self.forward_part


class ShareAccount:
    """What fine-tuning is owed of an engine's time (module docstring).

    Args:
        share: fine-tuning's least share of the engine's time, in (0, 1).
        window_s: the time whose share bounds the debt and the surplus, seconds (> 0).
    """

    def __init__(self, share: float, window_s: float) -> None:
        if not 0.0 < share < 1.0 or not window_s > 0:
            raise ValueError(f"a share account needs 0 < share < 1 and window_s > 0, got {share!r}, {window_s!r}")
        self.share, self.window_s = share, window_s
        self._pending: dict[int, PlannedSplit] = {}  # step id -> how the model divides it
        self.debt_s = 0.0  # fine-tuning time owed, measured seconds (< 0: a surplus)
        self._last_piece_s = 0.0  # fine-tuning's time in the last iteration that had any
        self.finetune_scale = 1.0  # measured / predicted fine-tuning time (moving average; kept by `clear`)
        self.inference_scale = 1.0  # the same for inference

    @property
    def window_debt_s(self) -> float:
        """What one window's time owes fine-tuning: the most the debt reaches."""
        return self.share * self.window_s

    def clear(self) -> None:
        """No job is runnable: the account starts again with the next one."""
        self._pending.clear()
        self.debt_s = self._last_piece_s = 0.0

    def planned(self, step_id: int, split: PlannedSplit) -> None:
        """The plan `step_id` was built; `split`: how the model divides it."""
        if len(self._pending) >= MAX_PENDING:
            self._pending.pop(next(iter(self._pending)))
        self._pending[step_id] = split

    def observe(self, step_id: int, measured_s: float, backward_s: float = 0.0) -> None:
        """The plan's result: the iteration measured `measured_s` (<= 0: not measured), `backward_s` of it
        after the fused forward (0: not said)."""
        split = self._pending.pop(step_id, None)
        if split is None:
            return
        total_s = measured_s if measured_s > 0 else split.predicted_s
        finetune_s = split.finetune_s(total_s, backward_s if measured_s > 0 else 0.0)
        if measured_s > 0:
            predicted_ft = split.predicted_s * split.finetune_part
            self.finetune_scale = _averaged(self.finetune_scale, finetune_s, predicted_ft)
            self.inference_scale = _averaged(self.inference_scale, total_s - finetune_s,
                                             split.predicted_s - predicted_ft)
        if finetune_s > 0:
            self._last_piece_s = finetune_s
        most_surplus = max(self.window_debt_s, self._last_piece_s)
        self.debt_s = min(max(self.debt_s + self.share * total_s - finetune_s, -most_surplus), self.window_debt_s)

    def owed_s(self, next_s: float) -> float:
        """Fine-tuning time the next iteration must carry, beside `next_s` of other work, to pay the debt:
        the x with x = debt + share x (next_s + x); <= 0 when fine-tuning is ahead."""
        return (self.debt_s + self.share * next_s) / (1.0 - self.share)


def _averaged(scale: float, measured_s: float, predicted_s: float) -> float:
    """`scale` moved towards measured / predicted (clipped to `SCALE_LIMITS`); unchanged when the model
    predicted nothing or the time is too small to say (under 0.1 ms)."""
    if predicted_s <= 0 or measured_s < 1e-4:
        return scale
    low, high = SCALE_LIMITS
    return scale + SCALE_SMOOTHING * (min(max(measured_s / predicted_s, low), high) - scale)
