"""The co-serving policy (`CoServingPolicy`): one inference planner in VTC order, fine-tuning jobs in
what it leaves. It is composed of

* an `InferencePlanner` (`inference/planner.py`) with a `VtcOrder` (`inference/admission_order.py`): continuous
  batching, chunked prefill, KV blocks, adapter slots, VTC admission across tenants, the TTFT guard and
  fan-outs;
* a `JobHost` (`finetune/host.py`): the fine-tuning jobs, chosen by the same counters (`finetune/roster.py`);
* a `FinetuneFloor` (`liveness.py`): fine-tuning's minimum share of the engine's time while a job is
  runnable, or why not;
* an `OnlineLatency` (`online_latency.py`): the latency model, refined from every measured iteration;
* a `FinetuneShare` strategy (`strategy.py`): how much fine-tuning work an iteration gets
  (`hybrid`, `temporal`, `dynamic_temporal`, `static_split`, none), built by name in `share_kinds`.

TTFT guard: while a request that has waited past the guard is waiting, the hybrid share adds no
fine-tuning work, so the running batch drains into it instead of into training windows.

KV memory: when a running or admitted request needs blocks and none are free, fine-tuning gives back
the blocks of its sequences in flight (most-served tenant first) before any inference request is
preempted (Harli's principle: training borrows memory, inference owns it), unless its share keeps a
range of its own (a static split); a sequence given back too often keeps its blocks, and admissions
leave free the blocks it still needs (`finetune.sequence_kv`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from coserve.contract.plan import IterationPlan, IterationResult
from coserve.finetune.host import JobHost
from coserve.inference.adapter_slots import AdapterSlots
from coserve.inference.admission_order import VtcOrder
from coserve.inference.kv_blocks import KVBlockManager
from coserve.inference.plan_checks import check_sequences
from coserve.inference.planner import InferencePlanner
from coserve.inference.request import Request, RequestStatus
from coserve.inference.request_rules import Budget
from coserve.planner.hold_kind import HoldKind
from coserve.planner.latency import LatencyModel, PlanFeatures, plan_features
from coserve.planner.liveness import FinetuneFloor, at_least
from coserve.planner.online_latency import OnlineLatency
from coserve.planner.settings import CoServingConfig
from coserve.planner.strategy import FinetuneShare
from coserve.tenancy.shared_vtc import SharedVtc
from coserve.tenancy.vtc import VirtualTokenCounter


class CoServingPolicy:
    """Co-serving: inference first (VTC order, TTFT guard), then fine-tuning work as `share` says, with
    the liveness floor (module docstring). A `ShareContext` to its share.

    Args:
        config: budgets, SLOs and fairness weights.
        kv: the engine's KV block manager (shared by inference requests and training sequences, unless
            `finetune_kv` is given).
        adapters: the engine's adapter bank slots.
        latency: the iteration latency model (refined online from measured iterations).
        share: the fine-tuning share strategy (`share_kinds.make_share` builds one by name).
        finetune_kv: fine-tuning's own KV range when `share.kv_fraction` is set (a static split,
            `split_kv`); None: `kv`. `build_policy` (`share_kinds`) cuts the cache as the share says.
        clock: seconds on the scale of `Request.arrival_time` (for the TTFT guard).
        shared: the counters of a `EngineCluster`, shared with the other engines' policies
            (`shared_vtc`); None: counters of its own (one engine).

    Raises:
        ValueError: `finetune_kv` given without `share.kv_fraction` or missing with it, its block size
            differs from `kv`'s, `kv` disagrees with `config`, or `shared` counts with other token
            weights than `config.vtc`.
    """

    def __init__(self, config: CoServingConfig, kv: KVBlockManager, adapters: AdapterSlots,
                 latency: LatencyModel, *, share: FinetuneShare, finetune_kv: KVBlockManager | None = None,
                 clock: Callable[[], float] = time.monotonic, shared: SharedVtc | None = None) -> None:
        if shared is not None and shared.vtc.weights != config.vtc:
            raise ValueError(f"the shared counters weigh tokens {shared.vtc.weights}, this policy's "
                             f"config {config.vtc}")
        if (finetune_kv is None) != (share.kv_fraction is None):
            raise ValueError("finetune_kv must be given exactly when the share keeps a KV range of its own "
                             f"(the {share.label}: kv_fraction={share.kv_fraction})")
        if finetune_kv is not None and finetune_kv.block_size != kv.block_size:
            raise ValueError(f"KV block sizes differ: {kv.block_size} and {finetune_kv.block_size}")
        self._co = config
        self._share = share
        self._clock = clock
        self._now = clock()
        if shared is None:
            self._vtc = VirtualTokenCounter(config.vtc, config.tenant_weights)
            backlogged: Callable[[str], bool] = self._waiting_has
        else:  # several engines: a tenant queued on any of them is backlogged (`shared_vtc`)
            self._vtc, backlogged = shared.vtc, shared.backlogged
            for tenant, weight in config.tenant_weights.items():
                self._vtc.ensure_tenant(tenant, weight)
        self._jobs = JobHost(self._vtc, kv if finetune_kv is None else finetune_kv, adapters,
                             default_weight=config.default_tenant_weight, also_backlogged=backlogged)
        self._order = VtcOrder(self._vtc, config.default_tenant_weight, config.ttft_guard_s,
                               self._jobs.sync_backlog,
                               input_charged=None if shared is None else shared.input_charged)
        self._inference = InferencePlanner(config.scheduler, kv, adapters, order=self._order,
                                             reclaim_kv=self._reclaim_kv,
                                             on_finished=share.watcher.on_request_finished,
                                             kv_reserve=self._kv_reserve)
        self._floor = FinetuneFloor(config.finetune_min_share, config.min_piece_tokens,
                                    config.scheduler.max_batch_tokens, config.max_backward_token_layers)
        self._latency = OnlineLatency(config, latency, share.learns_latency)

    def _waiting_has(self, tenant: str) -> bool:
        return self._order.queue.has_tenant(tenant)

    def has_backlog(self, tenant: str) -> bool:
        """Whether the tenant has a queued request or a runnable job here (its backlog on this engine)."""
        return self._order.queue.has_tenant(tenant) or self._jobs.roster.has_runnable(tenant)

    def _reclaim_kv(self, plan: IterationPlan) -> bool:
        return self._share.kv_fraction is None and self._jobs.roster.reclaim_kv(plan)

    def _kv_reserve(self) -> int:
        return self._jobs.roster.kv_reserve() if self._share.kv_fraction is None else 0

    # ------------------------------------------------------------------------------ requests

    def add_request(self, request: Request) -> None:
        """Queue a request in its tenant's sub-queue (an unknown tenant gets the default weight).

        Raises:
            ValueError: as `InferencePlanner.add_request`.
        """
        self._inference.add_request(request)
        self._share.watcher.on_request_added(request)

    def abort(self, request_id: str, status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> bool:
        """Finish a request now (`InferencePlanner.abort`); False when unknown or finished."""
        return self._inference.abort(request_id, status)

    def get_request(self, request_id: str) -> Request | None:
        """The unfinished request with this id, or None."""
        return self._inference.get_request(request_id)

    def withdraw(self, request_id: str) -> Request | None:
        """Take out a waiting request never admitted, for another engine (`InferencePlanner.withdraw`)."""
        return self._inference.withdraw(request_id)

    def has_unfinished(self) -> bool:
        return self._inference.has_unfinished()

    def has_work(self) -> bool:
        """Unfinished requests, engine state to free, or fine-tuning work."""
        return self._inference.has_work() or self._jobs.has_work

    # ------------------------------------------------------------------------------ readings

    @property
    def config(self) -> CoServingConfig:
        """The settings this policy plans with."""
        return self._co

    @property
    def kv(self) -> KVBlockManager:
        """The block manager inference allocates from (read it for usage and prefix-cache stats)."""
        return self._inference.kv

    @property
    def adapters(self) -> AdapterSlots:
        return self._inference.adapters

    @property
    def jobs(self) -> JobHost | None:
        """The fine-tuning jobs this policy runs (add, cancel, pause, resume, events); None when its
        share runs none (`NoFinetuneShare`)."""
        return self._jobs if self._share.hosts_jobs else None

    @property
    def share(self) -> FinetuneShare:
        """The fine-tuning share strategy this policy plans with."""
        return self._share

    @property
    def vtc(self) -> VirtualTokenCounter:
        """The virtual token counters (read them for fairness metrics)."""
        return self._vtc

    @property
    def slo_warning(self) -> str | None:
        """Set when the TPOT SLO cannot hold for one decode or a full decode batch (`OnlineLatency`)."""
        return self._latency.slo_warning

    # ------------------------------------------------------- what share strategies read (ShareContext)

    @property
    def num_waiting(self) -> int:
        return self._inference.num_waiting

    @property
    def num_running(self) -> int:
        return self._inference.num_running

    @property
    def running(self) -> Sequence[Request]:
        return self._inference.running

    @property
    def now(self) -> float:
        return self._now

    @property
    def latency(self) -> LatencyModel:
        return self._latency.model

    @property
    def overrun(self) -> float:
        return self._latency.overrun

    @property
    def floor(self) -> FinetuneFloor:
        return self._floor

    def clock(self) -> float:
        return self._clock()

    def overdue_waiting(self) -> Request | None:
        return self._order.overdue_waiting()

    def oldest_waiting_arrival(self) -> float | None:
        return self._order.queue.oldest_arrival()

    def has_runnable_job(self) -> bool:
        return self._jobs.has_runnable_job()

    # ---------------------------------------------------------------------------------- plan

    def plan(self) -> IterationPlan:
        """Decide the next iteration: inference (leaving room for a forward piece the floor owes), the
        liveness floor's piece if fine-tuning is owed its minimum share, then the share strategy's
        fine-tuning work.

        Raises:
            RuntimeError: the plan breaks the token or sequence budget (a bug, not bad input).
        """
        self._now = self._clock()
        self._order.start_plan(self._now)
        inference, roster, floor, share = self._inference, self._jobs.roster, self._floor, self._share
        plan = inference.new_plan()
        roster.apply_control(plan)
        runnable = share.floor_applies and self.has_runnable_job()
        latency, next_job = self._latency.model, roster.longest_waiting() if runnable else None
        floor.begin(runnable, latency)
        if share.begin_iteration(self):
            reserved = floor.forward_reserve(next_job, latency)
            inference.schedule(plan, Budget(tokens=max(0, share.inference_token_budget(self) - reserved)))
        base = plan_features(plan, inference.running_adapters.slots,
                             distinct_adapters=self._scheduled_adapters(plan))
        allowance = share.allowance(self, base)
        if runnable:  # first, so that the share cannot take the room it needs
            floor_piece = floor.allowance(next_job, latency, base, self._co.scheduler.max_batch_tokens)
            if floor_piece is not None:  # what the share would give that job, if more
                roster.fill_longest_waiting(plan, at_least(floor_piece, allowance))
        if allowance is not None:
            roster.fill(plan, allowance)
        elif runnable:
            floor.hold(HoldKind.SHARE, f"held back: the {share.label} gave this iteration to inference",
                       unless_said=True)
        floor.after_plan(plan, share.floor_applies and self.has_runnable_job())
        self._jobs.finetune_held_back = floor.held_back
        training = plan.training
        features = base.with_finetune(training.forward_tokens, training.backward_token_layers,
                                      len(training.forward_windows) + len(training.backward_tasklets))
        self._check_budgets(plan, features)
        self._latency.planned(plan.step_id, features)
        if runnable:
            floor.planned(plan.step_id, latency, base, training)
        return plan

    def _scheduled_adapters(self, plan: IterationPlan) -> int | None:
        """Distinct adapters of the plan's requests from the running tally when every running
        request is scheduled (most iterations: saves a lookup per request); None otherwise."""
        if len(plan.chunks) != self._inference.num_running:
            return None
        return self._inference.running_adapters.distinct_adapters

    def _check_budgets(self, plan: IterationPlan, features: PlanFeatures) -> None:
        """The inference scheduler's invariants, with inference and forward-window tokens inside the
        token budget they share (`plan_features` already refused empty chunks)."""
        max_tokens = self._co.scheduler.max_batch_tokens
        check_sequences(plan, self._inference.num_running, self._co.scheduler.max_num_seqs)
        total = features.prefill_tokens + features.decode_tokens + features.ft_forward_tokens
        if total > max_tokens:
            raise RuntimeError(f"plan {plan.step_id} has {total:.0f} inference + forward-window "
                               f"tokens, over max_batch_tokens={max_tokens}")

    # -------------------------------------------------------------------------------- update

    def update(self, plan: IterationPlan, result: IterationResult) -> list[Request]:
        """Apply the engine's result: requests (and their output charges), jobs, the latency model.

        Returns:
            The requests that received a token this step, in batch order.
        """
        touched = self._inference.update(plan, result)
        self._jobs.roster.update(plan, result)
        self._floor.observe(plan.step_id, result.timings)
        self._latency.observe(plan, result)
        self._share.watcher.on_tokens(self, touched)
        return touched
