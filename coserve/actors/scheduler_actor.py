"""`SchedulerActor`: the central actor. It decides; engines execute; the gateways hold the tokenizer.

It composes three parts, each a class of its own with its own tests: admission (`AdmissionControl`:
request keys, the tenants' quotas, adapter ids), the token streams the gateways read (`StreamHub`),
and the engines' decisions (a `EngineCluster`: one policy and `EngineCore` per engine, each with
its plan in flight; one engine is a cluster of one). Around them: the fine-tuning job manager and the
metrics. It sees token ids only: the gateway's `SchedulerFrontend` renders and encodes prompts,
decodes outputs and watches stop strings (`stop` ends a choice whose text reached one). On Ray it also
supervises each engine actor (`supervise`): a crashed engine's work is ended or moved (`engine_lost`),
and the engine Ray restarts is registered again. Its process imports no torch.

A plain class: `ray.remote(SchedulerActor)` makes it an async Ray actor in cluster mode; with `--local`
it lives in the gateway's process and its coroutines run on the gateway's event loop. Either way every
method runs on one event loop thread, so no state here needs a lock. Engines talk to it through
`exchange(engine_id, result) -> next plan` (one round trip per iteration), the two halves of the
iteration loop `EngineCore` (`apply` the result, `next_plan`).

Each engine's policy is built by a `PolicyFactory` (`coserve.cluster.policy_factory`) over the
cluster's shared counters; fine-tuning jobs run when the policies run jobs (`jobs` is a `JobHost`) and
the server has a data dir.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Iterable

from coserve.actors.admission import AdmissionControl
from coserve.actors.data_dir_lock import DataDirLock
from coserve.actors.fine_tuning import SchedulerLoop, open_fine_tuning
from coserve.actors.metrics import QueueState, SchedulerMetrics
from coserve.actors.scheduler_settings import SchedulerSettings
from coserve.actors.step_faults import StepFaults
from coserve.actors.stream_hub import StreamHub
from coserve.actors.streams import SubmissionState
from coserve.actors.training_service import TrainingService
from coserve.cluster.engine_cluster import EngineCluster
from coserve.cluster.engine_core import Step, StepFailed
from coserve.cluster.plan_wait import next_plan_when_ready
from coserve.cluster.policy_factory import EngineLayout, PolicyFactory
from coserve.contract.engine import EngineFailure
from coserve.contract.messages import Admission, Rejection, TokenBatch, TokenSubmission
from coserve.contract.plan import IterationPlan, IterationResult
from coserve.contract.training_calls import CallFailure, RunAnswer, RunQuery
from coserve.graders.rollout_grading import grading_pool
from coserve.inference.request import RequestStatus, expand_request
from coserve.jobs.manager import JobManager
from coserve.model.config import ModelConfig

logger = logging.getLogger(__name__)

# How long a scheduler that takes the data dir's lock itself (on Ray) waits for it: a replaced Serve
# replica's scheduler may still be exiting when the new one starts. A second server fails after it.
DATA_DIR_HANDOVER_S = 30.0


class SchedulerActor:
    """Admission, token streams and the iteration loops of every engine (module docstring).

    Args:
        settings: see `SchedulerSettings`.
        policy_factory: builds each engine's policy once its layout is known.
        data_lock: the data dir's lock, when this process took it already (`--local`); None: with a
            `settings.data_dir` it is taken here, waiting up to `DATA_DIR_HANDOVER_S` for a previous
            scheduler's process to end. It is released by `release_data_dir` (or when the process ends).

    Raises:
        DataDirLocked: another server holds `settings.data_dir` (before any job is touched).
    """

    def __init__(self, settings: SchedulerSettings, policy_factory: PolicyFactory,
                 data_lock: DataDirLock | None = None) -> None:
        if data_lock is None and settings.data_dir is not None:
            data_lock = DataDirLock.acquire(settings.data_dir, wait_s=DATA_DIR_HANDOVER_S)
        self._data_lock = data_lock
        self._settings = settings
        self._policy_factory = policy_factory
        self._model = ModelConfig.from_pretrained(settings.model)
        self._loop: asyncio.AbstractEventLoop | None = None  # the actor's, once it runs (`_wake`)
        self._grading_pool = grading_pool()  # reinforcement jobs' graders (threads start when first used)
        self._admission = AdmissionControl(settings.tenant_limits)
        self.metrics = SchedulerMetrics(settings.slo)
        self._cluster = EngineCluster(tenant_weights=policy_factory.tenant_weights)
        self._served_by: dict[str, str] = {}  # child request id -> the engine that produced its tokens
        self._streams = StreamHub()
        self._owner: dict[str, tuple[SubmissionState, int]] = {}  # child request id -> (submission, index)
        self._work = asyncio.Event()
        self._closed = False
        self._jobs: JobManager | None = None
        self._runs: TrainingService | None = None  # driven training runs (the Tinker API), with the jobs
        self._job_task: asyncio.Task[None] | None = None
        self._generations: dict[str, int] = {}  # +1 each time the engine is lost: its loop's calls end
        self._supervisors: dict[str, asyncio.Task[None]] = {}
        self._faults = StepFaults(self._cluster, self.metrics, self._fail_requests, self.engine_lost)

    # --------------------------------------------------------------------------- engines

    def register_engine(self, engine_id: str, layout: EngineLayout) -> None:
        """Add an engine, new or back after `engine_lost` (Ray restarted it): its policy over its layout;
        requests held for an engine and jobs waiting for one are placed on it. The first engine whose
        policy runs jobs opens the job manager.

        Raises:
            ValueError: an id already registered; an engine without a tokenizer when fine-tuning jobs
                run (they read training files with it).
        """
        if engine_id in self._cluster.engines:
            raise ValueError(f"engine {engine_id!r} is already registered")
        if self._settings.data_dir is not None and layout.tokenizer is None:
            raise ValueError(f"engine {engine_id!r} reported no tokenizer: training files cannot be read")
        config = self._settings.scheduler_config(layout)
        member = self._cluster.add_engine(engine_id, lambda shared: self._policy_factory(config, layout, shared))
        self._generations.setdefault(engine_id, 0)
        if self._settings.data_dir is not None and member.policy.jobs is not None and self._jobs is None:
            assert layout.tokenizer is not None  # refused above when fine-tuning jobs run (`data_dir`)
            side = open_fine_tuning(self._settings, self._cluster, layout.tokenizer, layout.max_model_len,
                                    self._model, SchedulerLoop(
                                        self.submit, self.stream, lambda: self._loop, self._wake,
                                        self._count_finetune, self._work.set), self._grading_pool)
            self._jobs, self._runs = side.jobs, side.runs
        self._work.set()  # held requests or waiting jobs may have been placed on it

    def engine_lost(self, engine_id: str, reason: str) -> None:
        """The engine died or its loop stopped; any call of its loop still waiting in `exchange` ends.

        Its requests without a token start over on the other engines, the others' streams end with an
        error that says so, and its jobs resume on another engine from their last checkpoint
        (`EngineCluster.engine_lost`). With no engine left, every live stream ends (new requests are
        a 503 until an engine is back), and the jobs wait for the next engine, with an event saying so.
        """
        if engine_id not in self._cluster.engines:
            return
        logger.error("engine %s lost: %s", engine_id, reason)
        self._generations[engine_id] += 1
        message = (f"The engine stopped before this request finished ({reason}); it is being restarted. "
                   "Retry the request.")
        failover = self._cluster.engine_lost(engine_id)
        ended = list(failover.stranded)
        if not self._cluster.engines:  # nothing left to serve the re-routable ones either
            ended += self._cluster.release_held()
        for request in ended:
            request.status = RequestStatus.FINISHED_ABORTED
        self._fail_requests((r.request_id for r in ended), message)
        logger.warning("engine %s lost: %d request(s) re-routed, %d held, %d ended", engine_id,
                       len(failover.rerouted), self._cluster.num_held, len(ended))
        if self._jobs is not None:
            self._jobs.record_events()  # where each job went (placed elsewhere, or waiting and why)
        self._work.set()

    async def supervise(self, engine_id: str, handle: object, link: object) -> None:
        """Watch the Ray engine actor `handle` and bring it back after a crash
        (`coserve.actors.engine_supervisor`); `link` is what its restarted loop talks through."""
        from coserve.actors.engine_supervisor import EngineSupervisor

        if engine_id not in self._supervisors:
            supervisor = EngineSupervisor(self, engine_id, handle, link)
            self._supervisors[engine_id] = asyncio.get_running_loop().create_task(supervisor.run())

    def _count_finetune(self, tenant: str, tokens: int, engine_id: str) -> None:
        self.metrics.count_tokens("finetune", tenant, tokens, engine_id)

    def _wake(self) -> None:
        """Wake the engine loops from another thread (a graded batch of rollouts)."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._work.set)

    def _start_job_loop(self) -> None:
        if self._jobs is not None and self._job_task is None:
            loop = self._loop = asyncio.get_running_loop()
            self._job_task = loop.create_task(self._jobs.run(self._work.set, lambda: self._closed))

    def engines(self) -> list[str]:
        return list(self._cluster.engines)

    async def exchange(self, engine_id: str,
                       result: IterationResult | EngineFailure | None) -> IterationPlan | None:
        """Apply the engine's last result and hand it the next plan; waits while there is no work.
        Each engine has its own plan in flight and its own call here.

        Returns:
            The next plan, or None when the scheduler is shut down or the engine was lost (its loop ends).
        """
        if engine_id not in self._cluster.engines:
            raise ValueError(f"unknown engine {engine_id!r}")
        generation = self._generations[engine_id]
        if result is not None:
            self._apply(engine_id, result)
            if len(self._cluster.engines) > 1:
                self._work.set()  # the others may take work this step left waiting (late binding)
        self._start_job_loop()
        return await next_plan_when_ready(
            self._cluster, engine_id, self._work,
            lambda: not self._closed and generation == self._generations[engine_id])

    # ---------------------------------------------------------------------------- requests

    async def submit(self, sub: TokenSubmission) -> Admission:
        """Admit the submission (`AdmissionControl`: its key, the tenant's quota), then queue its `n`
        children (each routed to an engine)."""
        if not self._cluster.engines or self._closed:
            return Admission(rejection=Rejection(503, "The server is not ready to serve requests.",
                                                 type="server_error"))
        charge = self._admission.admit(sub, key_in_use=self._streams.get(sub.request_id) is not None)
        if isinstance(charge, Rejection):
            self.metrics.finished(sub.tenant, "rejected", None)
            return Admission(rejection=charge)
        children = expand_request(sub.request_id, sub.prompt_token_ids, sub.sampling, sub.eos, charge.adapter,
                                  sub.tenant, retain_kv_s=sub.retain_kv_s)
        self._streams.drop_unread()
        state = SubmissionState(sub.tenant, children, len(sub.prompt_token_ids), charge.estimate, time.monotonic(),
                                self._streams.notifier(sub.origin), sub.origin)
        try:
            self._queue(sub.request_id, state)
        except ValueError as error:
            return Admission(rejection=Rejection(400, str(error), param="messages"))
        return Admission(prompt_tokens=len(sub.prompt_token_ids))

    async def stop(self, request_id: str, index: int) -> bool:
        """The gateway found a stop string in choice `index`: finish its request with `stop`. False when
        the request or the choice is unknown or already finished."""
        state = self._streams.get(request_id)
        if state is None or state.done or not 0 <= index < len(state.children):
            return False
        child = state.children[index]
        if child.is_finished or not self._cluster.abort(child.request_id, RequestStatus.FINISHED_STOPPED):
            return False
        state.emit()
        if state.all_finished():
            self._finalize(state, outcome=None)
        self._work.set()  # the next plan frees the stopped request's engine state
        return True

    def stream(self, request_id: str) -> AsyncIterator[TokenBatch]:
        """The request's output tokens, batch by batch, until a batch with `done`."""
        return self._streams.stream(request_id)

    async def poll(self, origin: str, timeout_s: float = 5.0) -> dict[str, TokenBatch]:
        """The pending batches of every request `origin` submitted, in one call (the Ray gateway's
        stream pump: one actor call per iteration whatever the number of live streams). Waits up to
        `timeout_s` for one; returns {} when none came."""
        return await self._streams.poll(origin, timeout_s)

    async def abort(self, request_id: str) -> bool:
        """Stop a request (its client went away). False when it is unknown or already finished."""
        state = self._streams.forget(request_id)
        if state is None or state.done:
            return False
        self._finish_all(state, RequestStatus.FINISHED_ABORTED)
        self._finalize(state, outcome="abort")
        self._work.set()  # the next plan frees the aborted requests' engine state
        return True

    async def training(self, query: RunQuery) -> RunAnswer:
        """A driven training run's query (`contract.training_calls`): create, call, await, read."""
        if self._runs is None:
            return CallFailure("training_unavailable", "this server runs no fine-tuning (it has no data dir, "
                               "or its fine-tuning share is none)", user=False)
        return await self._runs.answer(query)

    async def metrics_text(self) -> str:
        """Prometheus text of the scheduler's metrics."""
        self.metrics.finetune_stalled.set(self._jobs.watchdog.stalled if self._jobs is not None else 0)
        return self.metrics.render(self._queue_states())

    async def shutdown(self) -> None:
        """Fail what is in flight, then end the engines' loops (their next exchange returns None)."""
        self._closed = True
        for task in (self._job_task, *self._supervisors.values()):
            if task is not None:
                task.cancel()
        self._grading_pool.shutdown(wait=False, cancel_futures=True)
        self._fail_live("The server is shutting down.")

    def release_data_dir(self) -> None:
        """Give the data dir's lock back, once `shutdown` is done and the engine's loop has ended (its last
        result may still record a job's step); on Ray the process's end releases it."""
        if self._data_lock is not None:
            self._data_lock.release()

    def _fail_live(self, message: str) -> None:
        """End every live submission with `message` as its stream's error; wake the engine loops."""
        for state in self._streams.live():
            self._finish_all(state, RequestStatus.FINISHED_ABORTED)
            state.error = message
            self._finalize(state, outcome="error")
        self._work.set()

    def _fail_requests(self, request_ids: Iterable[str], message: str) -> None:
        """End the submissions of these child requests (a failed plan's; a lost engine's with tokens
        sent) with `message`; their other choices, on other engines too, end with them."""
        states = {id(o[0]): o[0] for rid in request_ids if (o := self._owner.get(rid)) is not None}
        for state in states.values():
            self._finish_all(state, RequestStatus.FINISHED_ABORTED)
            state.error = message
            self._finalize(state, outcome="error")

    # --------------------------------------------------------------------------- internals

    def _queue(self, request_id: str, state: SubmissionState) -> None:
        added: list[str] = []
        engines: list[str] = []
        try:
            for index, child in enumerate(state.children):
                engines.append(self._cluster.submit(child))
                added.append(child.request_id)
                self._owner[child.request_id] = (state, index)
        except ValueError:
            for child_id in added:
                self._cluster.abort(child_id)
                self._owner.pop(child_id, None)
            self._admission.refund(state.tenant, state.estimate)
            raise
        self._streams.add(request_id, state)
        self.metrics.count_tokens("prompt", state.tenant, state.prompt_tokens, engines[0])
        self._work.set()

    def _apply(self, engine_id: str, result: IterationResult | EngineFailure) -> None:
        """The engine's answer to the plan in flight, then the outputs. A failed step's work at fault fails
        alone (`StepFaults`); a step failed whole fails its work with a generic error, and so does a bug
        here; the engine loop goes on."""
        plan = self._cluster.in_flight(engine_id)
        try:
            if (step := self._cluster.apply(engine_id, result)) is not None:  # None: pieces being retried
                self._emit(engine_id, step)
        except StepFailed as failed:
            self._faults.plan_failed(engine_id, failed.plan, failed.message)
        except Exception as error:  # noqa: BLE001 - a bug here must not stop the engine loop
            logger.exception("applying the result of step %d failed", result.step_id)
            if plan is not None:
                self._faults.plan_failed(engine_id, plan, f"internal error: {type(error).__name__}: {error}")

    def _emit(self, engine_id: str, step: Step) -> None:
        """The outputs of an applied step: token streams, first tokens, metrics, job events."""
        self.metrics.iteration(engine_id)
        self._faults.applied(engine_id, step)
        logprobs = step.logprobs()
        changed: dict[int, SubmissionState] = {}
        now = time.monotonic()
        for request in step.advanced:
            owner = self._owner.get(request.request_id)
            if owner is None:
                continue
            state, index = owner
            self._served_by[request.request_id] = engine_id
            first = state.on_token(index, now, logprobs.get(request.request_id))
            if first is not None:
                self.metrics.first_token(state.tenant, first, engine_id)
            self.metrics.count_tokens("completion", state.tenant, 1, engine_id)
            changed[id(state)] = state
        for state in changed.values():
            state.emit()
            if state.all_finished():
                self._finalize(state, outcome=None)
        if self._jobs is not None:
            self._jobs.record_events(engine_id)
        if self._runs is not None:
            self._runs.after_step()

    def _finish_all(self, state: SubmissionState, status: RequestStatus) -> None:
        for child in state.children:
            if not child.is_finished:
                self._cluster.abort(child.request_id, status)

    def _queue_states(self) -> dict[str, QueueState]:
        states = {}
        for engine_id in self._cluster.engines:
            policy = self._cluster.member(engine_id).policy
            kv = policy.kv
            states[engine_id] = QueueState(waiting=policy.num_waiting, running=policy.num_running,
                                           kv_blocks_used=kv.num_blocks - kv.num_free_blocks,
                                           kv_blocks_total=kv.num_blocks)
        return states

    def _finalize(self, state: SubmissionState, outcome: str | None) -> None:
        """Close a submission: usage, metrics, quota refund, the stream's last batch."""
        for index, child in enumerate(state.children):
            self._owner.pop(child.request_id, None)
            self.metrics.finished(state.tenant, outcome or child.finish_reason or "abort", state.tpot(index),
                                  self._served_by.pop(child.request_id, None))
        self._admission.refund(state.tenant, state.estimate - state.prompt_tokens - state.completion_tokens())
        state.close()
