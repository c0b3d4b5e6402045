"""Which measured iterations the online latency model learns from, and how far one may move it.

The online refit (`LatencyModel.observe`) is least squares: left alone, one iteration that took 50x its
prediction (a first-call compile, page faults, another process taking the core) drags every coefficient
up, the policy then predicts that nothing fits under the SLO, plans no fine-tuning work, and without
fine-tuning work the model never sees the sample that would correct it. `SampleGuard` stands between
the measurements and the fit:

- **Warm-up.** Until the model was fitted (a profile, or the engine's start-up probe) or has taken
  `warmup_samples` measurements, it does not trust itself (`trusted` is False) and every sample is
  taken as measured: there is no prediction yet to compare with. The policy keeps fine-tuning to small
  pieces while the model is untrusted.
- **Outlier rejection.** Once trusted, a sample slower than `outlier_ratio` times its prediction is
  dropped, unless `max_consecutive_outliers` such samples came in a row: then the machine really did
  get slower and the samples are taken (clipped, below).
- **A bound on one sample's pull.** A taken sample is clipped into [prediction / max_step, prediction *
  max_step] before the fit sees it, so one sample moves the prediction at its own point by at most that
  factor. A model that predicts too much (a poisoned one) comes down by up to `max_step` per sample.

Plain Python, no state beyond counters: the guard decides, the model fits.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class SampleGuard:
    """Admits, clips or drops measured iteration times before the online fit (see module docstring).

    Args:
        warmup_samples: samples an unfitted model takes before it trusts itself.
        outlier_ratio: measured / predicted above this is an outlier (dropped while isolated).
        max_consecutive_outliers: outliers in a row after which they are taken (clipped) after all.
        max_step: a taken sample is clipped to within this factor of the prediction.
    """

    warmup_samples: int = 8
    outlier_ratio: float = 4.0
    max_consecutive_outliers: int = 3
    max_step: float = 2.0
    fitted: bool = False
    taken: int = 0
    dropped: int = 0
    _outliers_in_a_row: int = field(default=0, repr=False)

    def __post_init__(self) -> None:
        if self.warmup_samples < 0 or self.max_consecutive_outliers < 0:
            raise ValueError("SampleGuard counts must be >= 0")
        if not (self.outlier_ratio > 1.0 and self.max_step > 1.0):
            raise ValueError(f"SampleGuard outlier_ratio and max_step must be > 1, got "
                             f"{self.outlier_ratio!r} and {self.max_step!r}")

    @property
    def trusted(self) -> bool:
        """Whether the model's predictions rest on a fit or on enough measurements."""
        return self.fitted or self.taken >= self.warmup_samples

    def on_fit(self) -> None:
        """The model was fitted to a set of measurements: trusted from now on."""
        self.fitted = True
        self._outliers_in_a_row = 0

    def admit(self, predicted_s: float, measured_s: float) -> float | None:
        """The time the fit should learn for this iteration, or None to drop the sample."""
        if not self.trusted or predicted_s <= 0.0:
            self.taken += 1
            return measured_s
        if measured_s > self.outlier_ratio * predicted_s:
            self._outliers_in_a_row += 1
            if self._outliers_in_a_row <= self.max_consecutive_outliers:
                self.dropped += 1
                return None
        else:
            self._outliers_in_a_row = 0
        self.taken += 1
        return min(max(measured_s, predicted_s / self.max_step), predicted_s * self.max_step)
