"""Prometheus metrics of the scheduler, served as text by the gateway's `GET /metrics`.

They live in the SchedulerActor (it sees every request and every iteration, whatever the number of
gateway replicas), in a registry of their own (no process-global state: tests build many).

Fine-tuning hook: the hybrid policy's job bookkeeping counts trained tokens with
`count_tokens("finetune", tenant, n)`; `coserve_tokens_total{kind="finetune"}` and the tokens/s a
dashboard derives from it need nothing else.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# Seconds. TTFT on a CPU tiny model is milliseconds, on a busy GPU server up to seconds.
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
TOKEN_KINDS = ("prompt", "completion", "finetune")
# The fine-tuning throughput gauge averages over this window (a step lands every few seconds at most).
FINETUNE_RATE_WINDOW_S = 60.0


@dataclass(frozen=True, slots=True)
class Slo:
    """Latency objectives in seconds; None: not set (no attainment counted)."""

    ttft_s: float | None = None
    tpot_s: float | None = None


@dataclass(frozen=True, slots=True)
class QueueState:
    """A snapshot of the policy's queues and KV cache, read when metrics are rendered."""

    waiting: int
    running: int
    kv_blocks_used: int
    kv_blocks_total: int


class SchedulerMetrics:
    """Counters, gauges and histograms of one scheduler.

    Args:
        slo: the objectives attainment is counted against.
    """

    def __init__(self, slo: Slo = Slo(), clock: Callable[[], float] = time.monotonic) -> None:
        self.slo = slo
        self._clock = clock
        self._finetune_recent: deque[tuple[float, int]] = deque()  # (when, trained tokens) in the window
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.ttft = Histogram("coserve_time_to_first_token_seconds", "Time from arrival to the first "
                              "output token", ["tenant"], buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("coserve_time_per_output_token_seconds", "Mean time between output tokens "
                              "of a finished request", ["tenant"], buckets=TPOT_BUCKETS, registry=r)
        self.tokens = Counter("coserve_tokens", "Tokens processed, by kind (prompt, completion, "
                              "finetune) and tenant", ["kind", "tenant"], registry=r)
        self.requests = Counter("coserve_requests", "Finished chat requests by outcome (stop, length, "
                                "abort, error, rejected)", ["tenant", "outcome"], registry=r)
        self.slo_requests = Counter("coserve_slo_requests", "Requests checked against a latency SLO, "
                                    "by whether they met it", ["slo", "met"], registry=r)
        self.iterations = Counter("coserve_engine_iterations", "Engine iterations executed", registry=r)
        self.queue = Gauge("coserve_queue_requests", "Inference requests by state", ["state"], registry=r)
        self.kv_used = Gauge("coserve_kv_blocks_in_use", "KV cache blocks held by requests", registry=r)
        self.kv_total = Gauge("coserve_kv_blocks_total", "KV cache blocks of the engine", registry=r)
        self.finetune_rate = Gauge("coserve_finetune_tokens_per_second", "Trained tokens of completed "
                                   f"optimizer steps per second over the last {FINETUNE_RATE_WINDOW_S:g} s",
                                   registry=r)
        self.finetune_stalled = Gauge("coserve_finetune_jobs_stalled", "Running fine-tuning jobs without "
                                      "progress for longer than the watchdog's limit", registry=r)

    def count_tokens(self, kind: str, tenant: str, count: int) -> None:
        """Add `count` tokens of `kind` (one of TOKEN_KINDS) for `tenant`."""
        if kind not in TOKEN_KINDS:
            raise ValueError(f"token kind must be one of {TOKEN_KINDS}, got {kind!r}")
        if count:
            self.tokens.labels(kind, tenant).inc(count)
            if kind == "finetune":
                self._finetune_recent.append((self._clock(), count))

    def first_token(self, tenant: str, seconds: float) -> None:
        """A request's first output token arrived `seconds` after the request."""
        self.ttft.labels(tenant).observe(seconds)
        if self.slo.ttft_s is not None:
            self.slo_requests.labels("ttft", str(seconds <= self.slo.ttft_s).lower()).inc()

    def finished(self, tenant: str, outcome: str, tpot_s: float | None) -> None:
        """A request ended; `tpot_s` is its mean inter-token time (None with fewer than 2 tokens)."""
        self.requests.labels(tenant, outcome).inc()
        if tpot_s is None:
            return
        self.tpot.labels(tenant).observe(tpot_s)
        if self.slo.tpot_s is not None:
            self.slo_requests.labels("tpot", str(tpot_s <= self.slo.tpot_s).lower()).inc()

    def render(self, queues: QueueState | None) -> str:
        """The Prometheus text exposition, with the queue gauges set from `queues`."""
        if queues is not None:
            self.queue.labels("waiting").set(queues.waiting)
            self.queue.labels("running").set(queues.running)
            self.kv_used.set(queues.kv_blocks_used)
            self.kv_total.set(queues.kv_blocks_total)
        self.finetune_rate.set(self._finetune_tokens_per_s())
        return generate_latest(self.registry).decode("utf-8")

    def _finetune_tokens_per_s(self) -> float:
        cutoff = self._clock() - FINETUNE_RATE_WINDOW_S
        while self._finetune_recent and self._finetune_recent[0][0] < cutoff:
            self._finetune_recent.popleft()
        return sum(count for _, count in self._finetune_recent) / FINETUNE_RATE_WINDOW_S
