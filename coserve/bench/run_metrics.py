"""Metrics of one benchmark run: SLO attainment, throughputs, latency percentiles.

Definitions (all times from the run's `RequestRecord`s and `IterationRecord`s):

* TTFT of a request: from its arrival to the end of the iteration that sampled its first output token
  (queueing included).
* TPOT of a request: the mean gap between its consecutive output tokens,
  ``(t_last - t_first) / (n - 1)`` (DistServe's and FlexLLM's per-request TPOT). A request with one
  output token has no TPOT.
* SLO attainment: the share of *all* requests of the trace with TTFT <= `ttft_s` and TPOT <= `tpot_s`
  (when they have a TPOT). Runs stop a drain time after the arrival window (`RunLimits`), and a request
  still running then is judged on the tokens it produced so far (its TTFT is final, its TPOT so far is
  the mean of its gaps so far): a long answer that arrived late is not a miss only because the run
  ended. A request with no first token at the stop is a miss; the benchmark's drain is at least the
  TTFT SLO, so such a request has waited longer than the TTFT SLO and would miss anyway.
* inference tokens/s: useful inference tokens over the arrival window: each request's prompt counts
  once when its first token is sampled within the window, each output token when it is sampled
  within the window (recomputation after a preemption is not counted again).
* fine-tuning tokens/s: trained tokens (tokens with a target) of optimizer steps completed by the
  end of the window, over the window. A half-done batch counts nothing.
* steady fine-tuning tokens/s (`finetune_steady_tokens_per_s`, extra): the trained tokens of the
  completed steps after the first one in the window, over the time from the first to the last of them.
  A step is hundreds of tokens on a CPU, so the window rate above moves by a whole step's worth when a
  step lands just after the window ends; the steady rate does not depend on where the window cuts.
  None with fewer than two completed steps.
* fine-tuning sequences/s (`finetune_sequences_per_s`): the trained sequences of those completed steps
  over the window; a DPO pair is two sequences (its reference pass trains nothing and counts nothing).
* Percentiles (numpy's linear interpolation) of TTFT over requests that got a first token, of TPOT over
  requests that have one; None when there are none. `gap_p99_ms` is the p99 over every gap between
  consecutive tokens of every request: a per-request mean TPOT amortizes a long stall (a temporal
  sharing fine-tuning turn) over the request's tokens, the gap percentile shows it.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

from coserve.bench.replay import RunRecord


@dataclass(frozen=True, slots=True)
class SLO:
    """Latency targets, seconds."""

    ttft_s: float
    tpot_s: float

    def __post_init__(self) -> None:
        if not (self.ttft_s > 0 and self.tpot_s > 0):
            raise ValueError(f"SLO targets must be > 0, got ttft_s={self.ttft_s}, tpot_s={self.tpot_s}")


@dataclass(frozen=True, slots=True)
class RunMetrics:
    """One row of the benchmark's `runs` (the JSON's field names; latencies in milliseconds)."""

    policy: str
    rate: float
    slo_attainment: float | None
    inference_tokens_per_s: float
    finetune_tokens_per_s: float
    finetune_steady_tokens_per_s: float | None
    finetune_sequences_per_s: float  # trained sequences of steps completed within the window (DPO: 2 a pair)
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    ttft_mean_ms: float | None  # steadier than the p50 on a short run where bursts make TTFT bimodal
    tpot_p50_ms: float | None
    tpot_p99_ms: float | None
    tpot_mean_ms: float | None  # mean over requests of their TPOT (the simulator check uses it)
    gap_p99_ms: float | None  # p99 over every per-token gap of every request: shows stalls
    num_requests: int
    num_finished: int
    num_iterations: int

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def slo_attainment(run: RunRecord, slo: SLO) -> float | None:
    """Share of the run's requests meeting both SLOs (module docstring); None without requests."""
    if not run.requests:
        return None
    met = 0
    for r in run.requests:
        ttft, tpot = r.ttft_s, r.tpot_s
        if ttft is not None and ttft <= slo.ttft_s and (tpot is None or tpot <= slo.tpot_s):
            met += 1
    return met / len(run.requests)


def inference_tokens_per_s(run: RunRecord) -> float:
    """Prompt tokens (at the first token) plus output tokens sampled within the window, per second."""
    window = run.window_s
    total = 0
    for r in run.requests:
        if r.token_times and r.token_times[0] <= window:
            total += r.prompt_len
        total += sum(1 for t in r.token_times if t <= window)
    return total / window


def finetune_tokens_per_s(run: RunRecord) -> float:
    """Trained tokens of optimizer steps completed within the window, per second."""
    return sum(it.trained_tokens for it in run.iterations if it.end_s <= run.window_s) / run.window_s


def finetune_steady_tokens_per_s(run: RunRecord) -> float | None:
    """Trained tokens per second between the first and the last step completed within the window."""
    steps = [(it.end_s, it.trained_tokens) for it in run.iterations
             if it.trained_tokens and it.end_s <= run.window_s]
    if len(steps) < 2 or steps[-1][0] <= steps[0][0]:
        return None
    return sum(tokens for _, tokens in steps[1:]) / (steps[-1][0] - steps[0][0])


def percentile_ms(values: list[float], q: float) -> float | None:
    """The `q`th percentile of `values` (seconds) in milliseconds; None when there are none."""
    return float(np.percentile(values, q)) * 1000.0 if values else None


def summarize(run: RunRecord, slo: SLO) -> RunMetrics:
    """The run's metrics row."""
    ttfts = [t for t in (r.ttft_s for r in run.requests) if t is not None]
    tpots = [t for t in (r.tpot_s for r in run.requests) if t is not None]
    gaps = [b - a for r in run.requests for a, b in zip(r.token_times, r.token_times[1:])]
    return RunMetrics(
        policy=run.policy, rate=run.rate, slo_attainment=slo_attainment(run, slo),
        inference_tokens_per_s=inference_tokens_per_s(run),
        finetune_tokens_per_s=finetune_tokens_per_s(run),
        finetune_steady_tokens_per_s=finetune_steady_tokens_per_s(run),
        finetune_sequences_per_s=sum(it.trained_sequences for it in run.iterations
                                     if it.end_s <= run.window_s) / run.window_s,
        ttft_p50_ms=percentile_ms(ttfts, 50), ttft_p99_ms=percentile_ms(ttfts, 99),
        ttft_mean_ms=float(np.mean(ttfts)) * 1000.0 if ttfts else None,
        tpot_p50_ms=percentile_ms(tpots, 50), tpot_p99_ms=percentile_ms(tpots, 99),
        tpot_mean_ms=float(np.mean(tpots)) * 1000.0 if tpots else None,
        gap_p99_ms=percentile_ms(gaps, 99),
        num_requests=len(run.requests), num_finished=sum(r.finished for r in run.requests),
        num_iterations=len(run.iterations))


def relative_error(a: float | None, b: float | None) -> float:
    """|a - b| / |b| (b the reference); inf when exactly one is missing or b is 0 and a is not."""
    if a is None or b is None:
        return 0.0 if a is None and b is None else math.inf
    if b == 0:
        return 0.0 if a == 0 else math.inf
    return abs(a - b) / abs(b)
