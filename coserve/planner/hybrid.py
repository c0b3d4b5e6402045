"""The hybrid token share (the default `FinetuneShare`): inference first, then fine-tuning tokens up to
the SLO.

One iteration (FlexLLM §6.2, with Algorithm 4's fairness and a latency model instead of a fixed budget):

1. Running requests get their tokens (decodes, then the next prefill chunks), as in `InferencePlanner`.
2. Waiting requests are admitted in VTC order across tenants (`TenantQueues`): the least-counter
   tenant's earliest request first, charged `w_p` per prompt token once (a recompute after a
   preemption is not charged again: the tenant did not ask for it).
3. Fine-tuning work fills what the latency model leaves of the iteration: for the job picked by VTC,
   ``s = max{s : f(plan + s tokens) <= tpot_slo * (1 - safety_margin)}`` forward-window tokens (also
   within `max_batch_tokens`, which forward windows share with inference) or backward token-layers,
   by the job's phase; then the next job, with the plan grown by what the previous one took. Each
   job's call is counted as one more `ft_pieces` (a window, or a tasklet), and a backward budget that
   runs past the job's current layer one more per further layer (`backward_layers`, from the job's
   `layer_tokens`).

Bursts (`CoServingConfig.max_stall_ms`, off by default): the TPOT SLO is a per-request mean, so an
iteration may run longer than it when every running request has banked the time: one with n tokens,
the first at t0, keeps its mean within the target while the iteration takes at most
``target * n - (now - t0)``. Fine-tuning then waits (iterations run inference alone, faster than the
target) until every running request has banked at least twice the per-iteration budget, and then
fills one iteration with what is banked, up to the stall budget. Where an iteration's fixed cost is
large against the SLO (a CPU), this pays it once per burst instead of once per SLO-sized iteration.

Liveness (`CoServingPolicy`, `liveness.FinetuneFloor`): the SLO binds only while inference runs, so an
engine with no request running gives fine-tuning the whole iteration (`max_batch_tokens`, and up to
`max_backward_token_layers`); while the latency model is still warming up (`SampleGuard`), fine-tuning
gets small pieces beside inference; and while a job is runnable, floor pieces top fine-tuning up to its
minimum share of the engine's time (`finetune_min_share`) whatever the SLO.

The TTFT guard, KV reclaim, VTC charges and the online latency model are `CoServingPolicy`'s.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from coserve.contract.job_spec import JobPhase
from coserve.contract.plan import IterationPlan
from coserve.finetune.roster import Allowance, TrainingJob, fixed_allowance, whole_iteration_allowance
from coserve.inference.request import Request
from coserve.planner.backward_layers import backward_within
from coserve.planner.hold_kind import HoldKind
from coserve.planner.latency import PlanFeatures
from coserve.planner.strategy import RequestWatcher, ShareContext

__all__ = ["HybridShare", "MIN_BURST"]

# A burst starts once every running request has banked this many iteration budgets (up to the stall
# cap): waiting for the full cap made fewer, longer bursts, and new requests (which bank from zero)
# delayed them; starting at twice the budget trained 3-11% more tokens at rates 1-3 (40 s runs,
# 2026-11-21) with the same SLO attainment.
MIN_BURST = 2.0

_FORWARD_TOKEN = PlanFeatures(ft_forward_tokens=1.0)


class FirstTokenTimes:
    """When each running request got its first token (a `RequestWatcher`; kept only with bursts)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}  # request id -> when its first token came

    def on_request_added(self, request: Request) -> None:
        pass

    def on_tokens(self, ctx: ShareContext, touched: Sequence[Request]) -> None:
        if ctx.config.max_stall_ms is not None:
            now = ctx.clock()
            for request in touched:
                if request.num_output_tokens == 1 and not request.is_finished:
                    self.seconds[request.request_id] = now

    def on_request_finished(self, request: Request) -> None:
        self.seconds.pop(request.request_id, None)


class HybridShare:
    """Token-level co-serving (the default share): fine-tuning fills each iteration up to the TPOT SLO,
    or with `max_stall_ms` fills bursts paid for by the running requests' banked slack."""

    label = "hybrid share"
    hosts_jobs = True
    floor_applies = True
    learns_latency = True
    kv_fraction = None

    def __init__(self) -> None:
        self._first_tokens = FirstTokenTimes()
        self.watcher: RequestWatcher = self._first_tokens

    def begin_iteration(self, ctx: ShareContext) -> bool:
        return True

    def inference_token_budget(self, ctx: ShareContext) -> int:
        return ctx.config.scheduler.max_batch_tokens

    def _slack_s(self, ctx: ShareContext, target_s: float) -> float:
        """How long the next iteration may take with every running request still on time (inf when
        nothing runs).

        A request with n tokens, the first at t0, has n gaps after this iteration: its mean time per
        output token stays within the target while the iteration takes at most
        ``target_s * n - (now - t0)``. A request still in its prefill (no token yet) may wait until the
        TTFT guard, the delay after which a waiting request is overdue: ``guard - (now - arrival)``.
        """
        first, now, guard_s = self._first_tokens.seconds, ctx.now, ctx.config.ttft_guard_s
        slack = math.inf
        for request in ctx.running:
            t0 = first.get(request.request_id)
            if t0 is None:
                slack = min(slack, guard_s - (now - request.arrival_time))
            else:
                slack = min(slack, target_s * request.num_output_tokens - (now - t0))
        return slack

    def allowance(self, ctx: ShareContext, base: PlanFeatures) -> Allowance | None:
        config = ctx.config
        max_tokens = config.scheduler.max_batch_tokens
        inference_tokens = int(base.prefill_tokens + base.decode_tokens)
        if not ctx.num_running:
            # Liveness: the SLO binds only while inference runs. An engine with no request running
            # (none waits, or those waiting could not be admitted: their KV blocks are a kept
            # fine-tuning sequence's, `finetune.sequence_kv`, or an adapter slot is not free) gives
            # fine-tuning the whole iteration, whatever the latency model predicts, as when it trains
            # alone (`LLM.fine_tune`): forward and backward in the same plan.
            return whole_iteration_allowance(max_tokens, config.max_backward_token_layers)
        if ctx.overdue_waiting() is not None:
            ctx.floor.hold(HoldKind.TTFT_GUARD, "held back: a request waited past the TTFT guard and is admitted first")
            return None  # TTFT guard: the batch drains into the overdue request first
        if not ctx.latency.trusted:
            # Warming up: small pieces beside inference, so the model measures their cost.
            piece = config.min_piece_tokens
            return fixed_allowance(min(piece, max(0, max_tokens - inference_tokens)), piece)
        budget_s = self._finetune_budget_s(ctx)
        if budget_s is None:
            ctx.floor.hold(HoldKind.NOT_BANKED,
                           "held back: the running requests have not banked TPOT slack for a burst")
            return None
        queue_s = _queue_slack_s(ctx)
        if queue_s < budget_s:
            # Requests wait for admission (max_num_seqs, blocks) until running ones finish, which a longer
            # iteration delays: fine-tuning may take only what keeps the longest-waiting one within the TTFT
            # guard (past it, the guard above holds fine-tuning until it is admitted).
            ctx.floor.hold(HoldKind.ADMISSION, f"held back: {ctx.num_waiting} inference request(s) wait for "
                                               f"admission, the oldest near the TTFT guard")
            return None
        return _latency_allowance(ctx, base, budget_s / ctx.overrun, inference_tokens)

    def _finetune_budget_s(self, ctx: ShareContext) -> float | None:
        """The latency this iteration may be filled up to: the TPOT SLO's (minus the margin), or with
        `max_stall_ms` a burst of what every running request has banked, once that is at least
        `MIN_BURST` iteration budgets (or the stall cap, if smaller); None before. A request in its
        prefill limits a burst to what keeps its TTFT within the TTFT guard (`_slack_s`)."""
        stall_s = ctx.config.stall_budget_s
        if stall_s is None:
            return ctx.config.iteration_budget_s
        target_s = ctx.config.banked_target_s
        slack_s = self._slack_s(ctx, target_s)
        return min(slack_s, stall_s) if slack_s >= min(stall_s, MIN_BURST * target_s) else None


def _queue_slack_s(ctx: ShareContext) -> float:
    """How long the next iteration may take with the longest-waiting request not admitted yet still within
    the TTFT guard (inf when none waits)."""
    arrival = ctx.oldest_waiting_arrival()
    return math.inf if arrival is None else ctx.config.ttft_guard_s - (ctx.now - arrival)


def _latency_allowance(ctx: ShareContext, base: PlanFeatures, budget_s: float,
                       inference_tokens: int) -> Allowance:
    """Each job's share: what the latency model says fits in `budget_s` with the plan so far."""
    max_tokens = ctx.config.scheduler.max_batch_tokens
    max_layers = ctx.config.max_backward_token_layers
    latency, floor = ctx.latency, ctx.floor

    def allow(job: TrainingJob, plan: IterationPlan) -> tuple[int, int] | None:
        training = plan.training
        forward, backward = training.forward_tokens, training.backward_token_layers
        # One more piece for the work this job adds (a window, or at least one tasklet).
        pieces = len(training.forward_windows) + len(training.backward_tasklets) + 1
        features = base.with_finetune(forward, backward, pieces)
        predicted = latency.predict(features)
        if predicted >= budget_s:
            floor.hold(HoldKind.FULL, f"held back: predicted iteration {predicted * 1000:.0f} ms > the "
                       f"{budget_s * 1000:.0f} ms the TPOT SLO leaves")
            return None  # the iteration is full: no later job can add anything
        if job.phase is JobPhase.FORWARD:
            cap = max(0, max_tokens - inference_tokens - forward)
            return latency.max_extra_tokens(features, _FORWARD_TOKEN, budget_s, cap), 0
        cap = max(0, max_layers - backward)
        return 0, backward_within(latency, base, (forward, backward, pieces), budget_s, job.layer_tokens, cap)

    return allow
