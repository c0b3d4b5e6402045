"""What every co-serving policy shares (`CoServingPolicy`): VTC admission across tenants, fine-tuning
jobs and their liveness floor, the TTFT guard, KV reclaim from fine-tuning, output charges and the online
latency model. How much fine-tuning work an iteration gets is its `FinetuneShare` strategy's
(`finetune_share`: `hybrid`, `temporal`, `dynamic_temporal`, `static_split`, none), built by name in
`share_registry`.

TTFT guard: a request that has waited `ttft_guard_fraction * ttft_slo_ms` is admitted before every
other waiting request whatever the counters, and while one is waiting no fine-tuning work is added, so
the running batch drains into it instead of into training windows. For a fan-out (n > 1) the guard acts
for one sequence until one is admitted; the others wait in VTC order like separate requests
(`fanouts.py`: otherwise one big `n` took every free slot past the counters).

KV memory: when a running or admitted request needs blocks and none are free, fine-tuning gives back
the blocks of its sequences in flight (most-served tenant first) before any inference request is
preempted (Harli's principle: training borrows memory, inference owns it).

Output tokens are charged `w_q` each when they are sampled (`update`), and every measured iteration
refines the latency model online (`LatencyModel.observe`, through its `SampleGuard`).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence

from coserve.policies.adapter_slots import AdapterSlots
from coserve.policies.fanouts import FanOuts
from coserve.policies.fcfs import Budget, FCFSPolicy
from coserve.policies.finetune_share import FinetuneShare
from coserve.policies.hybrid_config import CoServingConfig
from coserve.policies.job_host import JobHost
from coserve.policies.kv_blocks import KVBlockManager
from coserve.policies.latency import LatencyModel, PlanFeatures, plan_features
from coserve.policies.liveness import FinetuneFloor
from coserve.policies.plan import IterationPlan, IterationResult
from coserve.policies.plan_checks import check_sequences
from coserve.policies.request import Request, RequestStatus
from coserve.policies.vtc import VirtualTokenCounter
from coserve.policies.waiting import TenantQueues, WaitingQueue

logger = logging.getLogger(__name__)
_WAITING = (RequestStatus.WAITING, RequestStatus.PREEMPTED)
# The measured/predicted ratio's moving average: weight of a new iteration, and bounds on one sample
# (a hiccup of the machine must not stop fine-tuning for long, nor a lucky run overfill iterations).
OVERRUN_SMOOTHING = 0.1
MIN_OVERRUN, MAX_OVERRUN = 0.5, 3.0


class CoServingPolicy(FCFSPolicy):
    """Co-serving: VTC admission, fine-tuning jobs, KV reclaim, accounting, the liveness floor
    (`liveness.FinetuneFloor`); how much fine-tuning work an iteration gets is `share`'s.

    Args:
        config: budgets, SLOs and fairness weights.
        kv: the engine's KV block manager (shared by inference requests and training sequences, unless
            `finetune_kv` is given).
        adapters: the engine's adapter bank slots.
        latency: the iteration latency model (refined online from measured iterations).
        share: the fine-tuning share strategy (`share_registry.make_share` builds one by name).
        finetune_kv: a KV range of fine-tuning's own (a static split, `split_kv`); None: `kv`.
        clock: seconds on the scale of `Request.arrival_time` (for the TTFT guard).

    Raises:
        ValueError: `finetune_kv`'s block size differs from `kv`'s, or `kv` disagrees with `config`.
    """

    def __init__(self, config: CoServingConfig, kv: KVBlockManager, adapters: AdapterSlots,
                 latency: LatencyModel, *, share: FinetuneShare, finetune_kv: KVBlockManager | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if finetune_kv is not None and finetune_kv.block_size != kv.block_size:
            raise ValueError(f"KV block sizes differ: {kv.block_size} and {finetune_kv.block_size}")
        self._co = config
        self._share = share
        self._latency = latency
        self._clock = clock
        self._vtc = VirtualTokenCounter(config.vtc, config.tenant_weights)
        self._jobs = JobHost(self._vtc, kv if finetune_kv is None else finetune_kv, adapters,
                             default_weight=config.default_tenant_weight, also_backlogged=self._waiting_has)
        self._roster = self._jobs.roster
        self._slots: dict[str, int] = {}  # running request -> adapter slot (for plan_features)
        self._slot_users: Counter[int] = Counter()  # adapter slot -> running requests using it
        self._input_charged: set[str] = set()
        self._planned: dict[int, PlanFeatures] = {}  # step id -> features, until its result
        # Measured / predicted time of iterations with fine-tuning work (moving average): what the
        # latency model's fit leaves as bias at the operating point (missing nonlinear terms, a slow
        # online fit). Iterations filled to the budget must take the SLO on average, so the budget
        # the model is asked about is divided by it.
        self._overrun = 1.0
        self._now = clock()
        self._overdue: list[Request] = []  # this plan's overdue waiting requests, oldest last
        self._fanouts = FanOuts()  # the guard acts for one sequence of a fan-out (n > 1), not all of them
        self._floor = FinetuneFloor(config.finetune_floor_every, config.finetune_floor_tokens,
                                    config.scheduler.max_batch_tokens)
        self.slo_warning: str | None = None  # set when the SLO cannot hold for a full decode batch
        # Decode iterations a model learned online measures before the SLO check runs again (0: never;
        # a fitted or loaded model was checked at construction).
        self._unchecked_decode_samples = 0 if latency.trusted else latency.guard.warmup_samples
        super().__init__(config.scheduler, kv, adapters)
        self._check_decode_batch_fits()

    def _check_decode_batch_fits(self) -> None:
        """Warn (`slo_warning`, logged) when one decode, or a full batch of them, already breaks the SLO
        by the latency model: such iterations leave fine-tuning only its liveness floor. Checked at
        construction, and for a model learned online once it has measured `warmup_samples` decode
        iterations."""
        for n in (1, self._co.scheduler.max_num_seqs):
            batch = PlanFeatures(decode_tokens=n, decode_context=n, num_sequences=n)
            predicted = self._latency.predict(batch)
            if predicted > self._co.iteration_budget_s:
                self.slo_warning = (
                    f"tpot_slo_ms={self._co.tpot_slo_ms:g} (minus the safety margin {self._co.safety_margin:g}) "
                    f"is below the predicted {predicted * 1000:.1f} ms of an iteration of {n} decode(s) on "
                    f"this machine (max_num_seqs={self._co.scheduler.max_num_seqs}): such iterations miss "
                    f"the SLO and fine-tuning gets only its liveness floor; raise --tpot-slo-ms"
                    + (" or lower --max-num-seqs" if n > 1 else ""))
                logger.warning("coserve: %s", self.slo_warning)
                return

    def _new_waiting_queue(self) -> WaitingQueue:
        return TenantQueues(self._vtc, self._jobs.sync_backlog)

    # ------------------------------------------------------------------------ tenants and jobs

    @property
    def config(self) -> CoServingConfig:
        """The settings this policy plans with."""
        return self._co

    @property
    def vtc(self) -> VirtualTokenCounter:
        """The virtual token counters (read them for fairness metrics)."""
        return self._vtc

    @property
    def latency(self) -> LatencyModel:
        return self._latency

    def add_request(self, request: Request) -> None:
        """Queue a request in its tenant's sub-queue (an unknown tenant gets the default weight)."""
        self._vtc.ensure_tenant(request.tenant, self._co.default_tenant_weight)
        super().add_request(request)
        self._fanouts.added(request)
        self._share.on_request_added(request)

    @property
    def jobs(self) -> JobHost | None:
        """The fine-tuning jobs this policy runs (add, cancel, pause, resume, events); None when its
        share runs none (`NoFinetuneShare`)."""
        return self._jobs if self._share.hosts_jobs else None

    def has_work(self) -> bool:
        """Unfinished requests, engine state to free, or fine-tuning work."""
        return super().has_work() or self._jobs.has_work

    def _waiting_has(self, tenant: str) -> bool:
        waiting = self._waiting
        assert isinstance(waiting, TenantQueues)
        return waiting.has_tenant(tenant)

    # ----------------------------------------------------------------------------------- plan

    def plan(self) -> IterationPlan:
        """Decide the next iteration: inference, then the share strategy's fine-tuning work."""
        self._now = self._clock()
        waiting = self._waiting
        assert isinstance(waiting, TenantQueues)
        # Oldest last: overdue_waiting pops admitted (or aborted) ones off the end.
        self._overdue = self._fanouts.guarded(waiting.arrived_by(self._now - self._co.ttft_guard_s))[::-1]
        plan = self._new_plan()
        self._roster.apply_control(plan)
        share = self._share
        floor_on = share.floor_applies
        runnable = floor_on and self.has_runnable_job()
        floor_due = floor_on and self._floor.due(plan.step_id, self._roster)
        if share.begin_iteration(self):
            reserved = self._floor.reserved_tokens(floor_due)
            self._schedule_inference(plan, Budget(tokens=max(0, share.inference_token_budget(self) - reserved)))
        base = plan_features(plan, self._slots, distinct_adapters=self._scheduled_adapters(plan))
        if floor_due:  # first, so that the policy's own share cannot take the room it needs
            inference_tokens = int(base.prefill_tokens + base.decode_tokens)
            floor = self._floor.allowance(inference_tokens, self._co.scheduler.max_batch_tokens)
            self._roster.fill_longest_waiting(plan, floor)
        allowance = share.allowance(self, base)
        if allowance is not None:
            self._roster.fill(plan, allowance)
        elif runnable:
            self._floor.hold(f"held back: the {share.label} gave this iteration to inference",
                             unless_said=True)
        self._floor.after_plan(plan, floor_on and self.has_runnable_job())
        self._jobs.finetune_held_back = self._floor.held_back
        training = plan.training
        features = base.with_finetune(training.forward_tokens, training.backward_token_layers,
                                      len(training.forward_windows) + len(training.backward_tasklets))
        self._check_budgets(plan, features)
        self._planned[plan.step_id] = features
        return plan

    def _scheduled_adapters(self, plan: IterationPlan) -> int | None:
        """Distinct adapters of the plan's requests from the running tally when every running
        request is scheduled (most iterations: saves a lookup per request); None otherwise."""
        if len(plan.chunks) != len(self._running):
            return None
        users = self._slot_users
        return len(users) - (-1 in users)

    @property
    def share(self) -> FinetuneShare:
        """The fine-tuning share strategy this policy plans with."""
        return self._share

    # ------------------------------------------------------- what share strategies read (ShareContext)

    def has_runnable_job(self) -> bool:
        return self._jobs.has_runnable_job()

    @property
    def running(self) -> Sequence[Request]:
        return self._running

    @property
    def now(self) -> float:
        return self._now

    @property
    def overrun(self) -> float:
        return self._overrun

    @property
    def floor(self) -> FinetuneFloor:
        return self._floor

    def clock(self) -> float:
        return self._clock()

    def overdue_waiting(self) -> Request | None:
        """The oldest request still waiting that had waited past the TTFT guard when this plan
        started, else None (the overdue list is read once per plan; admitted ones are skipped)."""
        overdue = self._overdue
        while overdue and overdue[-1].status not in _WAITING:
            overdue.pop()
        return overdue[-1] if overdue else None

    def _next_waiting(self) -> Request | None:
        overdue = self.overdue_waiting()
        return overdue if overdue is not None else super()._next_waiting()

    def _on_admitted(self, request: Request) -> None:
        adapter = request.adapter
        slot = self._adapters.slot_of(adapter.adapter_id) if adapter is not None else None
        slot = -1 if slot is None else slot
        self._slots[request.request_id] = slot
        self._slot_users[slot] += 1
        if request.request_id not in self._input_charged:
            self._input_charged.add(request.request_id)
            self._vtc.charge_input(request.tenant, len(request.prompt_token_ids))
        self._fanouts.admitted(request)

    def _reclaim_kv(self, plan: IterationPlan) -> bool:
        return self._share.reclaims_kv and self._roster.reclaim_kv(plan)

    def _check_budgets(self, plan: IterationPlan, features: PlanFeatures) -> None:
        """FCFS's invariants, with inference and forward-window tokens inside the token budget they
        share (`plan_features` already refused empty chunks)."""
        check_sequences(plan, len(self._running), self._co.scheduler.max_num_seqs)
        total = features.prefill_tokens + features.decode_tokens + features.ft_forward_tokens
        if total > self._co.scheduler.max_batch_tokens:
            raise RuntimeError(f"plan {plan.step_id} has {total:.0f} inference + forward-window "
                               f"tokens, over max_batch_tokens={self._co.scheduler.max_batch_tokens}")

    # --------------------------------------------------------------------------------- update

    def update(self, plan: IterationPlan, result: IterationResult) -> list[Request]:
        """Apply the engine's result: requests (as FCFS), output charges, jobs, the latency model."""
        touched = super().update(plan, result)
        for tenant, count in Counter(r.tenant for r in touched).items():
            self._vtc.charge_output(tenant, count)
        self._roster.update(plan, result)
        features = self._planned.pop(plan.step_id, None)
        if features is not None and result.timings.total_s > 0:
            if plan.training.forward_windows or plan.training.backward_tasklets:
                predicted = self._latency.predict(features)
                if predicted > 0:
                    ratio = min(max(result.timings.total_s / predicted, MIN_OVERRUN), MAX_OVERRUN)
                    self._overrun += OVERRUN_SMOOTHING * (ratio - self._overrun)
            self._latency.observe(features, result.timings.total_s)
            if features.decode_tokens and self._unchecked_decode_samples > 0:
                # A model learned online can say what a decode costs once it has measured some (an
                # idle engine's fine-tuning iterations alone cannot separate it from the constant).
                self._unchecked_decode_samples -= 1
                if not self._unchecked_decode_samples and self._latency.trusted:
                    self._check_decode_batch_fits()
        self._share.on_tokens(self, touched)
        return touched

    def _release_resources(self, request: Request) -> None:
        super()._release_resources(request)
        slot = self._slots.pop(request.request_id, None)
        if slot is not None:
            self._slot_users[slot] -= 1
            if not self._slot_users[slot]:
                del self._slot_users[slot]

    def _finish(self, request: Request, status: RequestStatus) -> None:
        super()._finish(request, status)
        self._input_charged.discard(request.request_id)
        self._fanouts.finished(request)
        self._share.on_request_finished(request)
