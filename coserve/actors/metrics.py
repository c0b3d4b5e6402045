"""Prometheus metrics of the scheduler, served as text by the gateway's `GET /metrics`.

They live in the SchedulerActor (it sees every request and every iteration, whatever the number of
gateway replicas), in a registry of their own (no process-global state: tests build many).

Fine-tuning hook: the hybrid policy's job bookkeeping counts trained tokens with
`count_tokens("finetune", tenant, n, engine)`; `coserve_tokens_total{kind="finetune"}` and the tokens/s a
dashboard derives from it need nothing else.

Per engine: the series of what an engine does carry an `engine` label (the scheduler's engine id,
`engine-0`, ...): iterations, tokens (prompt tokens on the engine a request was routed to, completion and
fine-tuning tokens on the engine that computed them), the queues and KV blocks of each engine's policy, and
SLO attainment (a request is counted on the engine that produced its tokens). Latency histograms and
request outcomes stay per tenant: sum `by (engine)` for a cluster view, or read one engine.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Mapping
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
        self._engines_shown: set[str] = set()  # the engines whose queue gauges the last render set
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.ttft = Histogram("coserve_time_to_first_token_seconds", "Time from arrival to the first "
                              "output token", ["tenant"], buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("coserve_time_per_output_token_seconds", "Mean time between output tokens "
                              "of a finished request", ["tenant"], buckets=TPOT_BUCKETS, registry=r)
        self.tokens = Counter("coserve_tokens", "Tokens processed, by kind (prompt, completion, "
                              "finetune), tenant and engine", ["kind", "tenant", "engine"], registry=r)
        self.requests = Counter("coserve_requests", "Finished chat requests by outcome (stop, length, "
                                "abort, error, rejected)", ["tenant", "outcome"], registry=r)
        self.slo_requests = Counter("coserve_slo_requests", "Requests checked against a latency SLO, "
                                    "by whether they met it and the engine that served them",
                                    ["slo", "met", "engine"], registry=r)
        self.iterations = Counter("coserve_engine_iterations", "Engine iterations executed", ["engine"],
                                  registry=r)
        self.queue = Gauge("coserve_queue_requests", "Inference requests by state and engine",
                           ["state", "engine"], registry=r)
        self.kv_used = Gauge("coserve_kv_blocks_in_use", "KV cache blocks held by requests", ["engine"],
                             registry=r)
        self.kv_total = Gauge("coserve_kv_blocks_total", "KV cache blocks of the engine", ["engine"],
                              registry=r)
        self.finetune_rate = Gauge("coserve_finetune_tokens_per_second", "Trained tokens of completed "
                                   f"optimizer steps per second over the last {FINETUNE_RATE_WINDOW_S:g} s",
                                   registry=r)
        self.step_faults = Counter("coserve_engine_step_faults", "Work that failed alone in an engine step "
                                   "(its own error; the step's other work completed), by engine and kind "
                                   "(request, job)", ["engine", "work"], registry=r)
        self.step_retries = Counter("coserve_engine_step_retries", "Sub-plans an engine ran to find the work "
                                    "at fault in a failed step", ["engine"], registry=r)
        self.failed_steps = Counter("coserve_engine_failed_steps", "Engine steps whose work failed whole "
                                    "(with a generic error: the work at fault could not be told apart)",
                                    ["engine"], registry=r)
        self.finetune_stalled = Gauge("coserve_finetune_jobs_stalled", "Running fine-tuning jobs without "
                                      "progress for longer than the watchdog's limit", registry=r)

    def count_tokens(self, kind: str, tenant: str, count: int, engine: str) -> None:
        """Add `count` tokens of `kind` (one of TOKEN_KINDS) for `tenant` on `engine`."""
        if kind not in TOKEN_KINDS:
            raise ValueError(f"token kind must be one of {TOKEN_KINDS}, got {kind!r}")
        if count:
            self.tokens.labels(kind, tenant, engine).inc(count)
            if kind == "finetune":
                self._finetune_recent.append((self._clock(), count))

    def iteration(self, engine: str) -> None:
        """`engine` executed an iteration."""
        self.iterations.labels(engine).inc()

    def first_token(self, tenant: str, seconds: float, engine: str) -> None:
        """A request's first output token arrived from `engine`, `seconds` after the request."""
        self.ttft.labels(tenant).observe(seconds)
        if self.slo.ttft_s is not None:
            self.slo_requests.labels("ttft", str(seconds <= self.slo.ttft_s).lower(), engine).inc()

    def finished(self, tenant: str, outcome: str, tpot_s: float | None, engine: str | None = None) -> None:
        """A request ended; `tpot_s` is its mean inter-token time on `engine` (None with fewer than 2
        tokens; `engine` is needed then only, a rejected request never reached one)."""
        self.requests.labels(tenant, outcome).inc()
        if tpot_s is None:
            return
        if engine is None:
            raise ValueError("a request with a TPOT has the engine that produced its tokens")
        self.tpot.labels(tenant).observe(tpot_s)
        if self.slo.tpot_s is not None:
            self.slo_requests.labels("tpot", str(tpot_s <= self.slo.tpot_s).lower(), engine).inc()

    def render(self, queues: Mapping[str, QueueState]) -> str:
        """The Prometheus text exposition, with the queue gauges set from `queues` (engine id -> its
        state; an engine no longer listed loses its series)."""
        for engine in self._engines_shown - set(queues):  # lost: its last numbers are no longer true
            for state_label in ("waiting", "running"):
                self.queue.remove(state_label, engine)
            self.kv_used.remove(engine)
            self.kv_total.remove(engine)
        self._engines_shown = set(queues)
        for engine, state in queues.items():
            self.queue.labels("waiting", engine).set(state.waiting)
            self.queue.labels("running", engine).set(state.running)
            self.kv_used.labels(engine).set(state.kv_blocks_used)
            self.kv_total.labels(engine).set(state.kv_blocks_total)
        self.finetune_rate.set(self._finetune_tokens_per_s())
        return generate_latest(self.registry).decode("utf-8")

    def _finetune_tokens_per_s(self) -> float:
        cutoff = self._clock() - FINETUNE_RATE_WINDOW_S
        while self._finetune_recent and self._finetune_recent[0][0] < cutoff:
            self._finetune_recent.popleft()
        return sum(count for _, count in self._finetune_recent) / FINETUNE_RATE_WINDOW_S
