"""How often a run iterated while its requests were live, against the pace of the TPOT SLO.

A request is live from its first output token to its last. A policy that keeps a request's mean TPOT
within the SLO T and samples its tokens as they are due (not holding them back to the end of what the
mean allows) runs about one iteration per T while the request is live, and iterations are shared by the
requests live at once. So over the periods when at least one request is live (their union, L seconds of
the window), such a policy runs about L / T iterations, each paying the per-iteration constant c: a
share ``c / T`` of those periods, whatever it does with fine-tuning. `pacing` measures a run's
iterations there against that pace (`per_tpot`: 1.0 runs exactly one per T; bursts spend banked slack,
so more iterations than that are shorter ones).

`slo_bound` charges only the iterations that requests with disjoint SLO windows force, which a schedule
could meet only by holding a request's tokens back to the end of its window (or its first token to the
end of the TTFT SLO) and then sampling them in a run of fast iterations. The gap between the two is what
pacing the tokens costs in iteration constants.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from coserve.bench.replay import RunRecord


@dataclass(frozen=True, slots=True)
class Pacing:
    """A run's iterations while requests were live (module docstring)."""

    window_s: float
    live_s: float  # seconds of the window with at least one request live
    iterations: int  # iterations that ended in those seconds
    tpot_s: float  # the TPOT SLO
    constant_s: float  # the latency model's per-iteration constant

    @property
    def per_tpot(self) -> float | None:
        """Iterations per TPOT SLO of live time (None when no request was live)."""
        return self.iterations * self.tpot_s / self.live_s if self.live_s > 0 else None

    @property
    def constant_share(self) -> float:
        """Those iterations' constants, as a share of the window."""
        return self.iterations * self.constant_s / self.window_s

    @property
    def paced_constant_share(self) -> float:
        """What one iteration per TPOT SLO of live time pays in constants, as a share of the window."""
        return self.live_s / self.tpot_s * self.constant_s / self.window_s

    def to_dict(self) -> dict[str, float | int | None]:
        return {"live_s": self.live_s, "iterations": self.iterations, "per_tpot": self.per_tpot,
                "constant_share": self.constant_share, "paced_constant_share": self.paced_constant_share}


def live_periods(record: RunRecord) -> list[tuple[float, float]]:
    """The union of the requests' live spans (first to last token) inside the window, sorted, disjoint."""
    spans = sorted((r.token_times[0], min(r.token_times[-1], record.window_s)) for r in record.requests
                   if len(r.token_times) >= 2 and r.token_times[0] < record.window_s)
    merged: list[tuple[float, float]] = []
    for start, end in spans:
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def pacing(record: RunRecord, tpot_s: float, constant_s: float) -> Pacing:
    """`record`'s iterations that ended while a request was live, against one per `tpot_s`."""
    periods = live_periods(record)
    starts = [start for start, _ in periods]
    count = 0
    for iteration in record.iterations:
        i = bisect.bisect_right(starts, iteration.end_s) - 1  # the last period starting at or before its end
        # An iteration ending exactly at a period's start sampled that period's first token: not inside it.
        if i >= 0 and starts[i] < iteration.end_s <= periods[i][1]:
            count += 1
    return Pacing(record.window_s, sum(end - start for start, end in periods), count, tpot_s, constant_s)
