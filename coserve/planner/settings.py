"""Settings of the co-serving policies (hybrid token policy and baselines), validated once and frozen."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from coserve.contract import defaults
from coserve.contract.job_spec import MIN_TASKLET_TOKENS
from coserve.inference.scheduler_config import SchedulerConfig
from coserve.tenancy.vtc import VTCWeights

DEFAULT_TPOT_SLO_MS = 100.0
DEFAULT_TTFT_SLO_MS = 5000.0
DEFAULT_BURST_MARGIN = 0.05


def _check_positive(name: str, value: float) -> None:
    # `not value > 0` also rejects NaN.
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 \
            or math.isinf(value):
        raise ValueError(f"CoServingConfig.{name} must be a finite number > 0, got {value!r}")


@dataclass(frozen=True, kw_only=True, slots=True)
class CoServingConfig:
    """Budgets of one co-serving iteration: the inference limits, the SLOs and the fairness weights.

    Raises:
        ValueError: a setting is out of range (the message names it), including a token budget smaller
            than one decode batch (`max_batch_tokens < max_num_seqs`).
    """

    scheduler: SchedulerConfig
    """Inference limits: max_num_seqs, max_batch_tokens (shared with fine-tuning forward windows), ..."""

    tpot_slo_ms: float = DEFAULT_TPOT_SLO_MS
    """Time per output token target: an iteration with running decodes must not take longer."""

    ttft_slo_ms: float = DEFAULT_TTFT_SLO_MS
    """Time to first token target; the TTFT guard acts on waiting requests well before it."""

    safety_margin: float = 0.1
    """Fraction of `tpot_slo_ms` kept free for the latency model's error (its held-out MAPE)."""

    burst_margin: float = DEFAULT_BURST_MARGIN
    """With bursts (`max_stall_ms`): the fraction of `tpot_slo_ms` kept free in what running requests
    bank. Their slack is measured on the clock, so a burst that runs over the model's prediction is paid
    back by the next iterations. What is not paid back: the error of a request's last burst (spread over
    its tokens), and an iteration whose prefill chunks alone outlast a request's slack. So the margin is
    smaller than `safety_margin`, which covers one iteration's error. In the simulator on the
    co-serving benchmark's quick setup (2026-11-28) 0.03 let such iterations push 7% of the requests at
    rate 2 past the TPOT SLO; 0.05 kept every one within it (TPOT p99 0.96 x the SLO)."""

    ttft_guard_fraction: float = 0.5
    """A request that has waited `ttft_guard_fraction * ttft_slo_ms` is overdue: it is admitted first,
    whatever the counters say, and fine-tuning takes no new work until it is admitted."""

    max_stall_ms: float | None = None
    """None (FlexLLM): every iteration with running decodes stays within the TPOT SLO. Set (at least
    `tpot_slo_ms`): the SLO holds for each request's *mean* time per output token (how TPOT is measured,
    e.g. by vLLM's benchmarks) and fine-tuning spends the slack: iterations run without fine-tuning,
    faster than the SLO, until every running request has banked time (at least two SLO-sized
    iterations), and then one iteration is filled with fine-tuning for what is banked, up to
    `max_stall_ms`. No gap between two tokens of a request is planned longer (minus the safety
    margin), and a request in its prefill limits a burst to what keeps its TTFT within the TTFT
    guard (`ttft_guard_fraction`). Worth it where an iteration's fixed cost is large against the SLO
    (a CPU): one long iteration pays it once instead of every time."""

    max_backward_token_layers: int = 8192
    """Backward tasklet work per iteration at most (tokens x layers), whatever the latency allows:
    bounds the activations a tasklet batch recomputes, and the VTC quantum M of fine-tuning."""

    finetune_min_share: float = defaults.FINETUNE_MIN_SHARE
    """Liveness (`liveness.FinetuneFloor`): while a fine-tuning job is runnable, fine-tuning gets at
    least this fraction of the engine's time over any window of about a second, whatever the SLO, the
    queue or the latency model say (a tight SLO, a full batch, waiting requests): floor pieces sized by
    the latency model top up what the share gives. So no setting freezes a job; inference pays at most
    this fraction of the engine's time for it. In (0, 1)."""

    min_piece_tokens: int = 16
    """The smallest floor piece (forward tokens, or backward token-layers), and the size of every piece
    while the latency model is still warming up. At least a job's smallest backward tasklet (16 tokens),
    else a backward piece could be refused."""

    vtc: VTCWeights = field(default_factory=VTCWeights)
    """Token costs w_p, w_q, w_r of the virtual token counters."""

    tenant_weights: Mapping[str, float] = field(default_factory=dict)
    """Tenant -> share under contention; tenants met later get `default_tenant_weight`."""

    default_tenant_weight: float = 1.0

    def __post_init__(self) -> None:
        for name in ("tpot_slo_ms", "ttft_slo_ms", "ttft_guard_fraction", "default_tenant_weight"):
            _check_positive(name, getattr(self, name))
        for name in ("safety_margin", "burst_margin"):
            if isinstance(getattr(self, name), bool) or not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"CoServingConfig.{name} must be in [0, 1), got {getattr(self, name)!r}")
        if self.ttft_guard_fraction > 1.0:
            raise ValueError("CoServingConfig.ttft_guard_fraction must be in (0, 1], got "
                             f"{self.ttft_guard_fraction!r}")
        if self.max_stall_ms is not None:
            _check_positive("max_stall_ms", self.max_stall_ms)
            if self.max_stall_ms < self.tpot_slo_ms:
                raise ValueError(f"CoServingConfig.max_stall_ms={self.max_stall_ms!r} is below "
                                 f"tpot_slo_ms={self.tpot_slo_ms!r}")
        if isinstance(self.finetune_min_share, bool) or not 0.0 < self.finetune_min_share < 1.0:
            raise ValueError("CoServingConfig.finetune_min_share must be a fraction in (0, 1), got "
                             f"{self.finetune_min_share!r}")
        if self.min_piece_tokens < MIN_TASKLET_TOKENS:
            raise ValueError(f"CoServingConfig.min_piece_tokens must be >= {MIN_TASKLET_TOKENS} (a "
                             f"job's smallest backward tasklet), got {self.min_piece_tokens}")
        if self.max_backward_token_layers < 1:
            raise ValueError("CoServingConfig.max_backward_token_layers must be >= 1, got "
                             f"{self.max_backward_token_layers}")
        for tenant, weight in self.tenant_weights.items():
            _check_positive(f"tenant_weights[{tenant!r}]", weight)
        sched = self.scheduler
        if sched.max_batch_tokens < sched.max_num_seqs:
            raise ValueError(f"SchedulerConfig.max_batch_tokens={sched.max_batch_tokens} is smaller than "
                             f"one decode batch of max_num_seqs={sched.max_num_seqs} tokens")

    @property
    def iteration_budget_s(self) -> float:
        """The latency an iteration may be planned up to: the TPOT SLO minus the safety margin."""
        return self.tpot_slo_ms * (1.0 - self.safety_margin) / 1000.0

    @property
    def stall_budget_s(self) -> float | None:
        """The longest a fine-tuning burst is planned (`max_stall_ms` minus the burst margin); None:
        no bursts."""
        if self.max_stall_ms is None:
            return None
        return self.max_stall_ms * (1.0 - self.burst_margin) / 1000.0

    @property
    def banked_target_s(self) -> float:
        """With bursts, the mean time per output token running requests bank against: the TPOT SLO
        minus the burst margin."""
        return self.tpot_slo_ms * (1.0 - self.burst_margin) / 1000.0

    @property
    def ttft_guard_s(self) -> float:
        """Waiting time after which a request is overdue."""
        return self.ttft_slo_ms * self.ttft_guard_fraction / 1000.0
