"""Dynamic temporal sharing: FlexLLM Appendix A / Algorithm 3, a temporal-sharing baseline whose
interval between fine-tuning iterations follows the inference load (queue length, batch size, arrival
and completion rates), between 64 and 512 inference iterations.

`DynamicInterval` is Algorithm 3 line by line. The paper leaves the initial values out; we start as a
fresh fixed-frequency baseline would: `s = 64` steps to the first switch, `f_p = 64`, `d = 0`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from coserve.inference.request import Request
from coserve.planner.strategy import ShareContext
from coserve.planner.temporal import TurnTakingShare

MIN_INTERVAL, MAX_INTERVAL = 64, 512


@dataclass
class DynamicInterval:
    """Algorithm 3's state: steps left before the next switch (s), the previous frequency (f_p), the
    decision delay (d), and the statistics since the last switch (Q, B, r_a, r_c)."""

    s: float = float(MIN_INTERVAL)
    f_p: float = float(MIN_INTERVAL)
    d: int = 0
    queue_lengths: list[int] = field(default_factory=list)  # Q
    batch_sizes: list[int] = field(default_factory=list)  # B
    arrivals: int = 0  # r_a
    completions: int = 0  # r_c

    def step(self, q: int, b: int, a: int, c: int) -> bool:
        """SCHEDULER_STEP(q, b, a, c) after an inference iteration; True: switch to fine-tuning.

        Args:
            q: waiting requests; b: running requests; a: arrivals and c: completions since the last
                call.
        """
        self.arrivals += a
        self.completions += c
        self.queue_lengths.append(q)
        self.batch_sizes.append(b)
        self.s -= 1
        if self.s > 0:
            return False  # line 18: continue inference
        self.d += 1
        if self.d >= 3:  # lines 11-13: recompute only every third switch (against oscillation)
            self.s = self.compute_next_interval()
            self.d = 0
        else:
            self.s = min(float(MAX_INTERVAL), self.f_p * 1.1)  # line 15
        self._reset_stats()
        return True

    def compute_next_interval(self) -> float:
        """COMPUTE_NEXT_INTERVAL (lines 19-42): the pressure metric mapped to [64, 512]."""
        if not self.queue_lengths:
            return float(MIN_INTERVAL)
        n = len(self.queue_lengths)
        q_mean = sum(self.queue_lengths) / n
        q_max = max(self.queue_lengths)
        # line 24 computes the mean batch size, which no later line uses; kept out.
        arrival_rate = self.arrivals / n
        completion_rate = self.completions / n
        p_q = min(1.0, q_mean / 20.0)  # queue pressure
        p_s = min(0.5, q_max / 25.0)  # spike pressure
        p_b = max(0.0, (arrival_rate - completion_rate) / 8.0)  # backlog pressure
        p = p_q + p_s + p_b
        if p <= 0.8:
            f = float(MIN_INTERVAL)
        elif p >= 2.0:
            f = float(MAX_INTERVAL)
        else:
            p_n = (p - 0.8) / 1.2
            f = MIN_INTERVAL + p_n * 0.6 * (MAX_INTERVAL - MIN_INTERVAL)
            f *= 1.35  # line 38: stabilization adjustment
        f_s = (f + 2 * self.f_p) / 3  # hysteresis
        self.f_p = f_s
        f_s = max(f_s, MIN_INTERVAL + 16)
        return min(max(f_s, float(MIN_INTERVAL)), float(MAX_INTERVAL))

    def _reset_stats(self) -> None:
        self.queue_lengths.clear()
        self.batch_sizes.clear()
        self.arrivals = self.completions = 0


class DynamicTurns:
    """Algorithm 3's turns: the interval follows the load counted between two plans (a `TurnSchedule`,
    and the `RequestWatcher` that counts arrivals and completions)."""

    def __init__(self) -> None:
        self.interval = DynamicInterval()
        self._arrivals = 0
        self._completions = 0

    def on_request_added(self, request: Request) -> None:
        self._arrivals += 1

    def on_request_finished(self, request: Request) -> None:
        self._completions += 1

    def on_tokens(self, ctx: ShareContext, touched: Sequence[Request]) -> None:
        pass

    def finetune_turn_due(self, ctx: ShareContext) -> bool:
        due = self.interval.step(ctx.num_waiting, ctx.num_running, self._arrivals, self._completions)
        self._arrivals = self._completions = 0
        return due


def dynamic_temporal_share() -> TurnTakingShare:
    """Temporal sharing with Algorithm 3's adaptive interval (see the module docstring)."""
    turns = DynamicTurns()
    return TurnTakingShare(turns, "dynamic temporal share", watcher=turns)
