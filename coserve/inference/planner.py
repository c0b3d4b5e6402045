"""The inference planner (`InferencePlanner`): continuous batching, a token budget, chunked prefill, over KV
blocks and adapter slots, admitting waiting requests in its `AdmissionOrder` (arrival, or VTC with the TTFT
guard).

No prefill and decode phases (vLLM v1): each request's `num_computed_tokens` catches up with `num_tokens`,
an iteration gives each some tokens under one budget; a long prompt is computed in chunks over several
iterations, a decode is a chunk of one token.

The order-independent rules (`prefix_salt`, `num_new_tokens`, `check_stop`, `Budget`) are `request_rules`; the
requests by state and what each holds, `request_book`.
Alone it is a policy (`plan`, `update`); `CoServingPolicy` holds one and adds fine-tuning to its plans.
"""

from __future__ import annotations

from collections.abc import Callable

from coserve.contract.plan import IterationPlan, IterationResult, NewSequence, ScheduledChunk
from coserve.inference.adapter_slots import AdapterSlots, RunningAdapters
from coserve.inference.admission_order import AdmissionOrder, FifoOrder
from coserve.inference.kv_blocks import KVBlockManager
from coserve.inference.plan_checks import check_kv_matches, check_sequences, check_token_budget
from coserve.inference.request import Request, RequestStatus
from coserve.inference.request_book import RequestBook
from coserve.inference.request_rules import (
    Budget,
    check_new_request,
    check_stop,
    clamp_new_tokens,
    num_new_tokens,
    prefix_salt,
)
from coserve.inference.scheduler_config import SchedulerConfig


def _no_reclaim(plan: IterationPlan) -> bool:
    del plan
    return False


def _ignore(request: Request) -> None:
    del request


def _no_reserve() -> int:
    return 0


class InferencePlanner:
    """Continuous batching: running requests first, then waiting requests in the admission order.

    Args:
        config: budgets and limits.
        kv: the KV block manager of the engine this policy plans for.
        adapters: the adapter bank slots of that engine.
        order: which waiting request goes next (default: arrival order, `FifoOrder`).
        reclaim_kv: frees KV blocks held by lower-priority work before an inference request is
            preempted; returns whether it freed any (co-serving: fine-tuning gives back the blocks
            it borrowed, Harli's principle). Default: nothing to reclaim.
        on_finished: called with each request that finished, after its resources were released.
        kv_reserve: free KV blocks an admission must leave (co-serving: the blocks a fine-tuning sequence
            that keeps its memory still needs, `finetune.sequence_kv`); running requests may use them.
            Default: none.

    Raises:
        ValueError: `kv` disagrees with `config` (block size, prefix caching), or a sequence of
            `max_model_len` tokens needs more blocks than the KV cache has.
    """

    def __init__(self, config: SchedulerConfig, kv: KVBlockManager, adapters: AdapterSlots, *,
                 order: AdmissionOrder | None = None,
                 reclaim_kv: Callable[[IterationPlan], bool] = _no_reclaim,
                 on_finished: Callable[[Request], None] = _ignore,
                 kv_reserve: Callable[[], int] = _no_reserve) -> None:
        check_kv_matches(config, kv)
        self._config = config
        self._kv = kv
        self._adapters = adapters
        self._order = FifoOrder() if order is None else order
        self._reclaim_kv = reclaim_kv
        self._kv_reserve = kv_reserve
        self._book = RequestBook(kv, adapters, self._order, on_finished)
        self._requests, self._waiting, self._running = self._book.requests, self._book.waiting, self._book.running
        self._next_step_id = 0

    # ------------------------------------------------------------------------------- requests

    def add_request(self, request: Request) -> None:
        """Queue a new request at the back of the waiting queue.

        Raises:
            ValueError: empty prompt, prompt longer than max_model_len, duplicate id, a negative
                adapter id, or a request that is not WAITING.
        """
        check_new_request(request, self._config.max_model_len)
        self._book.add(request)

    def abort(self, request_id: str, status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> bool:
        """Finish a request now (a client abort, or a stop string found by the output processor).

        Its blocks and adapter pin are released at once; the engine drops its state in the next plan.

        Returns:
            False when the request is unknown or already finished (nothing to do).

        Raises:
            ValueError: `status` is not a finished status.
        """
        if not status.is_finished:
            raise ValueError(f"abort needs a finished status, got {status.name}")
        request = self._requests.get(request_id)
        if request is None:
            return False
        self._book.finish(request, status)
        return True

    def get_request(self, request_id: str) -> Request | None:
        """The unfinished request with this id, or None."""
        return self._requests.get(request_id)

    def withdraw(self, request_id: str) -> Request | None:
        """Take out a waiting request that was never admitted (no blocks, no slot, no engine state) so
        that another engine can queue it; None when there is no such request."""
        return self._book.withdraw(request_id)

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    def has_work(self) -> bool:
        """Unfinished requests, or finished ones whose engine state the next plan must free."""
        return bool(self._requests) or self._book.has_freed

    @property
    def kv(self) -> KVBlockManager:
        """The block manager this policy allocates from (read it for usage and prefix-cache stats)."""
        return self._kv

    @property
    def adapters(self) -> AdapterSlots:
        return self._adapters

    @property
    def jobs(self) -> None:
        """The inference planner runs no fine-tuning jobs (`CoServingPolicy` does)."""
        return None

    @property
    def running(self) -> list[Request]:
        """The running requests in admission order (read only: the last one is preempted first)."""
        return self._running

    @property
    def running_adapters(self) -> RunningAdapters:
        """The running requests' adapter slots (for the latency model's features)."""
        return self._book.running_adapters

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    # ---------------------------------------------------------------------------------- plan

    def plan(self) -> IterationPlan:
        """Decide the next iteration: running requests first, then admissions in arrival order.

        Admissions happen only when nothing was preempted in this step: a preemption means memory
        is short, and admitting would just preempt again next step.

        Raises:
            RuntimeError: the plan breaks the token or sequence budget (a bug, not bad input).
        """
        plan = self.new_plan()
        self.schedule(plan, Budget(tokens=self._config.max_batch_tokens))
        check_token_budget(plan, self._config.max_batch_tokens)
        check_sequences(plan, len(self._running), self._config.max_num_seqs)
        return plan

    def new_plan(self) -> IterationPlan:
        """An empty plan with the next step id that frees what finished since the last plan."""
        plan = IterationPlan(step_id=self._next_step_id, freed=self._book.take_freed())
        self._next_step_id += 1
        return plan

    def schedule(self, plan: IterationPlan, budget: Budget) -> None:
        """Add inference to `plan` within `budget`: running requests, then admissions (none in a step
        that preempted)."""
        preempted = self._schedule_running(plan, budget)
        if not preempted:
            self._schedule_waiting(plan, budget)

    def _schedule_running(self, plan: IterationPlan, budget: Budget) -> bool:
        """Give tokens to running requests in order, preempting from the back when blocks run out.

        This loop runs once per running request per iteration: it reads attributes into locals and
        builds chunks inline, because planning time is on the critical path of every iteration.

        Returns:
            Whether any request was preempted.
        """
        preempted = False
        running, chunks = self._running, plan.chunks
        append_chunk, new_tuple = chunks.append, tuple.__new__  # see ScheduledChunk
        snapshots, block_size = self._kv.table_snapshots, self._kv.block_size
        threshold = self._config.long_prefill_threshold
        tokens = budget.tokens
        # Preemption removes requests at or after the current one; a list iterator then just ends
        # earlier, so iterating `running` while it shrinks from the back is safe.
        for request in running:
            if tokens <= 0:
                break
            start, total = request.num_computed_tokens, request.num_tokens
            count = total - start
            if count != 1:  # a decode (1 token) always fits: tokens > 0 and any threshold is >= 1
                count = clamp_new_tokens(count, tokens, threshold)
                if count == 0:
                    continue
            request_id = request.request_id
            table = snapshots.get(request_id)  # the blocks it has usually cover a decode
            if table is None or start + count > len(table) * block_size:
                table, preempted_now = self._allocate_or_preempt(request, start + count, plan)
                preempted |= preempted_now
                if table is None:  # it was the last one; nothing after it to schedule
                    break
            chunk = (request_id, start, count, table, start + count == total)
            append_chunk(new_tuple(ScheduledChunk, chunk))
            tokens -= count
        budget.tokens = tokens
        return preempted

    def _allocate_or_preempt(self, request: Request, end: int,
                             plan: IterationPlan) -> tuple[tuple[int, ...] | None, bool]:
        """Grow a running request's blocks to `end` positions: fine-tuning gives blocks back first,
        then running requests are preempted from the back (always this one or one after it, so no
        chunk already scheduled loses its blocks).

        Returns:
            The block table (None when the request itself was preempted), and whether any request
            was preempted.
        """
        preempted = False
        while (table := self._kv.allocate_table(request.request_id, end)) is None:
            if self._reclaim_kv(plan):
                continue
            victim = self._running[-1]
            self._book.preempt(victim, plan)
            preempted = True
            if victim is request:
                return None, preempted
        return table, preempted

    def _schedule_waiting(self, plan: IterationPlan, budget: Budget) -> None:
        while budget.tokens > 0 and len(self._running) < self._config.max_num_seqs:
            request = self._order.next_waiting()
            # Strict order: nobody overtakes the head. Not idling: with nothing running every adapter
            # slot is unpinned and any request fits the cache (checked at construction), once a
            # fine-tuning sequence holding the `kv_reserve` is done (with nothing running, fine-tuning
            # gets whole iterations).
            if request is None or not self._try_admit(request, plan, budget):
                break
            self._book.admitted(request)

    def _try_admit(self, request: Request, plan: IterationPlan, budget: Budget) -> bool:
        """Reserve blocks and an adapter slot for a waiting request and emit its first chunk.

        Returns False, leaving the request waiting with no blocks and no pin, when the blocks or the
        adapter slot are not available (matched prefix blocks go back to the cache).
        """
        # Checked first because a granted adapter may have evicted another one: it cannot be undone.
        if request.adapter is not None and not self._adapters.can_acquire(request.adapter):
            return False
        request_id = request.request_id
        token_ids = request.all_token_ids()
        if self._config.enable_prefix_caching:
            request.num_computed_tokens = self._kv.match_prefix(request_id, token_ids,
                                                                prefix_salt(request))
        count = num_new_tokens(request, budget.tokens, self._config.long_prefill_threshold)
        while not self._allocate_admitted(request_id, request.num_computed_tokens + count):
            if not self._reclaim_kv(plan):
                self._kv.free(request_id)  # give back the matched prefix blocks
                request.num_computed_tokens = 0
                return False
        if request.num_cached_tokens is None:  # a preempted request's recompute is not the client's reuse
            request.num_cached_tokens = request.num_computed_tokens
        adapter_slot = self._book.pin_adapter(request, plan)
        plan.new_sequences.append(NewSequence(
            request_id=request_id,
            token_ids=token_ids,
            sampling=request.sampling,
            num_output_tokens=request.num_output_tokens,
            adapter_slot=adapter_slot,
        ))
        self._book.entered_engine(request_id)
        self._emit_chunk(request, count, plan)
        budget.tokens -= count
        return True

    def _allocate_admitted(self, request_id: str, end: int) -> bool:
        """Blocks for a request being admitted, leaving the `kv_reserve` free; False: they do not fit."""
        reserve = self._kv_reserve()
        if reserve and self._kv.blocks_needed(request_id, end) > self._kv.num_free_blocks - reserve:
            return False
        return self._kv.allocate_slots(request_id, end)

    def _emit_chunk(self, request: Request, count: int, plan: IterationPlan) -> None:
        start = request.num_computed_tokens
        plan.chunks.append(ScheduledChunk(
            request_id=request.request_id,
            start=start,
            num_tokens=count,
            block_table=self._kv.block_table(request.request_id),
            sample=start + count == request.num_tokens,
        ))

    # -------------------------------------------------------------------------------- update

    def update(self, plan: IterationPlan, result: IterationResult) -> list[Request]:
        """Apply what the engine did: advance computed tokens, append samples, finish requests.

        Requests aborted after the plan was made are skipped.

        Returns:
            The requests that received a token this step (finished ones included), in batch order.

        Raises:
            ValueError: the result belongs to another step, or lacks a token for a sampled chunk.
        """
        if result.step_id != plan.step_id:
            raise ValueError(f"result of step {result.step_id} applied to plan {plan.step_id}")
        sampled = {token.request_id: token for token in result.sampled}
        touched: list[Request] = []
        for chunk in plan.chunks:
            request = self._requests.get(chunk.request_id)
            if request is None:
                continue
            request.num_computed_tokens = chunk.start + chunk.num_tokens
            self._cache_new_full_blocks(request, chunk)
            if not chunk.sample:
                continue
            token = sampled.get(chunk.request_id)
            if token is None:
                raise ValueError(f"step {result.step_id}: no sampled token for {chunk.request_id!r}")
            request.append_output_token(token.token_id)
            touched.append(request)
            status = RequestStatus.FINISHED_GRAMMAR_ERROR if token.grammar_error else \
                check_stop(request, token.token_id, self._config.max_model_len)
            if status is not None:
                self._book.finish(request, status)
        self._order.sampled(touched)
        return touched

    def _cache_new_full_blocks(self, request: Request, chunk: ScheduledChunk) -> None:
        block_size = self._config.block_size
        end = chunk.start + chunk.num_tokens
        # Most decode steps complete no block; skip building the token list for them.
        if not self._config.enable_prefix_caching or end // block_size == chunk.start // block_size:
            return
        self._kv.cache_full_blocks(request.request_id, request.all_token_ids(), end,
                                   prefix_salt(request))
