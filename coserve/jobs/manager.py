"""Fine-tuning jobs on the scheduler's side: the metadata store says what should run, the policy runs it.

The gateway only writes intents into the store (a new job in `validating_files`, `cancelled`,
`paused`, `queued` again on resume). `JobManager.run`, the scheduler's job loop, brings the policy in
line with them: it validates and tokenizes new jobs, starts queued ones, pauses, resumes and cancels,
and after a restart resumes `running` jobs from their last checkpoint. The store is the source of
truth, so a restart and a normal start take the same path. `JobManager.record_events` writes what the
jobs did back (`events.py`).

A job's failure is the job's. Whatever raises while one job is prepared, resumed, started, paused,
resumed or cancelled, or while its events are recorded, fails that job with an error saying so
(`failures.py`), never the loop's pass: the other jobs' intents are applied in the same pass.
Preparing a job (reading and tokenizing its files: seconds for a big file) runs beside the passes, on
threads of its own, at most one job per tenant at a time and `MAX_PREPARING` in all, so one tenant's
file delays neither another tenant's preparation nor anyone's cancels and pauses.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from coserve.contract.job_runner import JobRunner
from coserve.contract.messages import AdapterSpec
from coserve.jobs.dedicated_jobs import DedicatedJobs, is_dedicated
from coserve.jobs.events import JobEvents, Running
from coserve.jobs.failures import JobStage, failure, record_failure
from coserve.jobs.preparation import FineTuningSettings, JobPreparation
from coserve.jobs.prepared_job import PreparedJob
from coserve.jobs.resume import resume_spec
from coserve.jobs.storage import JobStorage
from coserve.jobs.watchdog import JobWatchdog
from coserve.store import MetadataStore
from coserve.store.records import JobRecord, JobStatus
from coserve.tenancy.quotas import TenantLimits

logger = logging.getLogger(__name__)

# The `engine` label of the tokens dedicated Ray Train runs train (they run on no engine).
DEDICATED_ENGINE_LABEL = "dedicated"
# How often the job loop looks for new, paused, resumed or cancelled fine-tuning jobs in the store.
RECONCILE_INTERVAL_S = 0.25
# Jobs prepared at once (one per tenant): the threads share the GIL with the loop, so more only divides it.
MAX_PREPARING = 4


@dataclass(slots=True)
class Intent:
    """What the store asks of one job: start it (`prepared`), cancel it (`cancel_id`), or move it to
    `record.status` (paused, or queued again: resumed)."""

    record: JobRecord | None
    prepared: PreparedJob | None
    cancel_id: str | None = None

    @property
    def job_id(self) -> str:
        if self.cancel_id is not None:
            return self.cancel_id
        assert self.record is not None  # only a cancellation may lack the record (the job is gone)
        return self.record.id


def open_job_manager(settings: FineTuningSettings, coserved: JobRunner, tokenizer: Any,
                     limits: Mapping[str, TenantLimits] | None,
                     on_trained: Callable[[str, int, str], None] | None = None) -> JobManager:
    """A job manager over the metadata store in `settings.data_dir`, with its own tokenizer (the engine's,
    rebuilt torch-free: `coserve.frontend.tokenizer`): training files are tokenized on a worker thread
    (`JobManager.run`). With `settings.dedicated`, large jobs run on Ray Train runs of their own."""
    store = MetadataStore(settings.data_dir)
    dedicated = None if settings.dedicated is None else DedicatedJobs(
        settings.dedicated, store, settings.base_model_path, settings.data_dir)
    return JobManager(store, coserved, tokenizer, settings, limits, on_trained=on_trained, dedicated=dedicated)


class JobManager:
    """Keeps the policy's jobs in line with the store; see the module docstring."""

    def __init__(self, store: MetadataStore, coserved: JobRunner, tokenizer: Any,
                 settings: FineTuningSettings, limits: Mapping[str, TenantLimits] | None = None,
                 clock: Callable[[], float] = time.time,
                 on_trained: Callable[[str, int, str], None] | None = None,
                 dedicated: DedicatedJobs | None = None) -> None:
        self._store, self._coserved, self._tokenizer = store, coserved, tokenizer
        self._settings, self._limits, self._clock = settings, dict(limits or {}), clock
        self._running: dict[str, Running] = {}  # touched on the event loop only
        self._prepared: dict[str, PreparedJob] = {}  # validated, not yet started (set by the preparing threads)
        self._preparing: dict[str, str] = {}  # tenant -> the job being prepared for it (`run`'s threads)
        self._unrecordable: set[str] = set()  # jobs whose failure the store refused: not tried again
        self.watchdog = JobWatchdog(settings.stall_after_s)
        self._storage = JobStorage(store, self._limits)
        self._preparation = JobPreparation(store, tokenizer, settings, self._limits, self._storage)
        # on_trained: (tenant, trained tokens of a completed step, engine), for metrics
        self._events = JobEvents(store, settings.base_model_id, self._storage, self._running, clock, on_trained)
        self._dedicated = dedicated  # the jobs that train on Ray Train (None: no Ray)

    def adapter_of(self, tenant: str, model: str) -> AdapterSpec | None:
        """The adapter of a model the tenant may use (None: this server's base model); LookupError naming
        it otherwise. Any thread (the store locks)."""
        if model == self._settings.base_model_id:
            return None
        record = self._store.models.get(tenant, model)
        if record is None or record.adapter_path is None:
            raise LookupError(f"{model!r} is not a model this server serves to tenant {tenant!r}")
        return AdapterSpec(model, record.adapter_path)

    @property
    def store(self) -> MetadataStore:
        return self._store

    @property
    def num_running(self) -> int:
        return len(self._running)

    # -------------------------------------------------------------------------- store -> policy

    @property
    def running(self) -> dict[str, str]:
        """Job id -> tenant of the jobs the policy runs (a copy, for `collect`)."""
        return {job_id: r.record.tenant for job_id, r in self._running.items()}

    def reconcile(self) -> None:
        """Apply the store's intents now (`collect`, preparing jobs on the calling thread, then `apply`)."""
        self.apply(self.collect(self.running))

    def collect(self, running: Mapping[str, str]) -> list[Intent]:
        """The store's intents, after preparing (validating, tokenizing) the jobs that need it here: a new
        job is then started by the next call, one resumed after a restart by this one. Any thread.

        `running`: the jobs the policy runs, as `running` returned them on the loop.
        """
        intents, pending = self.read_intents(running)
        for record in pending:
            self.prepare(record)
            if record.status != JobStatus.VALIDATING_FILES and record.id in self._prepared:
                intents.extend(self._start_intent(record))
        return intents

    def read_intents(self, running: Mapping[str, str]) -> tuple[list[Intent], list[JobRecord]]:
        """The store's intents for prepared and running jobs, and the jobs to prepare first (new ones, and
        queued or running ones not prepared since a restart). Any thread; quick: nothing is tokenized."""
        intents: list[Intent] = []
        pending: list[JobRecord] = []
        active = self._store.jobs.active()
        for record in active:
            if record.id in self._unrecordable:
                continue
            to_start = record.id not in running and record.status in (JobStatus.QUEUED, JobStatus.RUNNING)
            if record.status == JobStatus.VALIDATING_FILES or to_start:
                if record.id not in self._prepared:
                    pending.append(record)
                elif to_start:
                    intents.extend(self._start_intent(record))
            elif record.id in running and record.status in (JobStatus.PAUSED, JobStatus.QUEUED):
                intents.append(Intent(record, None))
        for job_id, tenant in running.items():
            current = self._store.jobs.get(tenant, job_id)
            if current is None or current.status == JobStatus.CANCELLED:
                intents.append(Intent(current, None, cancel_id=job_id))
        for job_id in set(self._prepared) - {record.id for record in active}:  # cancelled before it started
            self._prepared.pop(job_id, None)
        return intents, pending

    def prepare(self, record: JobRecord) -> None:
        """Validate and tokenize a job (`JobPreparation`), kept for its start: a new job is `queued` then,
        one resumed after a restart keeps its status. Any thread; never raises: a job that cannot be
        prepared fails saying why (`failures.failure`)."""
        current = None
        try:
            current = self._store.jobs.get(record.tenant, record.id)
            if current is None or current.status.is_terminal or current.status == JobStatus.PAUSED \
                    or record.id in self._prepared or record.id in self._running:
                return  # cancelled, paused, prepared or started since it was read
            new = current.status == JobStatus.VALIDATING_FILES
            self._prepared[record.id] = self._preparation.prepare(current, resume=not new)
            if new:
                self._store.events.add(record.id, "Validated the training file")
                self._store.jobs.update(record.id, status=JobStatus.QUEUED)
        except Exception as err:  # noqa: BLE001 - a job's failure is the job's (module docstring)
            self._prepared.pop(record.id, None)
            self._give_up(current or record, err, JobStage.PREPARING)

    def _start_intent(self, record: JobRecord) -> list[Intent]:
        """A prepared job's start, resuming from its last checkpoint when it has one (a checkpoint that
        cannot be read fails the job)."""
        prepared = self._prepared.pop(record.id, None)
        if prepared is None:  # dropped by its preparing thread meanwhile (cancelled): nothing to start
            return []
        try:
            prepared.spec = resume_spec(self._store, record, prepared.spec)
        except Exception as err:  # noqa: BLE001 - a job's failure is the job's
            self._give_up(record, err, JobStage.RESUMING)
            return []
        return [Intent(record, prepared)]

    def _give_up(self, record: JobRecord, err: Exception, stage: JobStage) -> None:
        """Fail a job that does not run yet with why `stage` raised `err`. A job whose failure the store
        refuses too is left alone from then on (and logged), not tried again every pass."""
        if stage is JobStage.PREPARING and isinstance(err, ValueError):
            logger.info("fine-tuning job %s of %s cannot run: %s", record.id, record.tenant, err)
        else:
            logger.error("fine-tuning job %s of %s failed while %s", record.id, record.tenant, stage.value,
                         exc_info=err)
        try:
            record_failure(self._store, record.id, failure(err, stage))
        except Exception:  # noqa: BLE001 - the store refused it; nothing more can be said to the tenant
            logger.exception("fine-tuning job %s: its failure could not be recorded", record.id)
            self._unrecordable.add(record.id)

    def apply(self, intents: list[Intent]) -> None:
        """Hand the collected intents to the runners. On the scheduler's event loop only. An intent that
        raises fails its own job (`JobEvents.abandon`); the others are applied."""
        for intent in intents:
            try:
                self._apply(intent)
            except Exception as err:  # noqa: BLE001 - a job's failure is the job's
                stage = JobStage.STARTING if intent.prepared is not None else JobStage.CONTROLLING
                self._events.abandon(intent.job_id, err, stage)

    def _apply(self, intent: Intent) -> None:
        running = self._running.get(intent.job_id)
        if intent.cancel_id is not None:
            if running is not None:
                running.runner.cancel(intent.job_id)  # it reports the cancellation
            return
        record = intent.record
        assert record is not None  # only a cancellation may lack the record
        if intent.prepared is not None:
            if running is None:
                self._start(record, intent.prepared)
        elif running is None:
            return  # it ended meanwhile
        elif record.status == JobStatus.PAUSED and running.record.status != JobStatus.PAUSED:
            running.runner.pause(intent.job_id)
            running.record = record
        elif record.status == JobStatus.QUEUED:  # resumed
            running.runner.resume(intent.job_id)
            running.record = self._store.jobs.update(intent.job_id, status=JobStatus.RUNNING)

    def _runners(self) -> list[JobRunner]:
        return [self._coserved] + ([] if self._dedicated is None else [self._dedicated])

    def _start(self, record: JobRecord, prepared: PreparedJob) -> None:
        """Hand a job to its runner (on the event loop)."""
        dedicated = self._dedicated is not None and is_dedicated(record)
        runner: JobRunner = self._dedicated if dedicated else self._coserved  # type: ignore[assignment]
        runner.start(prepared.spec)
        # Its job object: None while it waits for an engine (a notice says why).
        self._running[record.id] = running = Running(record, runner, runner.get(record.id), self._clock())
        try:
            running.record = self._store.jobs.update(record.id, status=JobStatus.RUNNING)
        except ValueError:
            return  # paused or cancelled since it was read: the next pass applies that to the runner
        resumed = prepared.spec.resume_from is not None
        self._store.events.add(record.id, "Resumed from the last checkpoint" if resumed
                               else "Fine-tuning job started")

    async def run(self, wake: Callable[[], None], stopped: Callable[[], bool]) -> None:
        """The scheduler's job loop: every `RECONCILE_INTERVAL_S` a pass (`_pass`) and the watchdog (`watch`);
        `wake()` the scheduler when something changed. Jobs are prepared on threads of their own."""
        pool = ThreadPoolExecutor(MAX_PREPARING, thread_name_prefix="job-preparation")
        try:
            while not stopped():
                if await self._pass(pool):
                    wake()
                try:
                    self.watch()
                except Exception:  # noqa: BLE001 - the watchdog's events are advice; the loop goes on
                    logger.exception("fine-tuning job watchdog failed")
                await asyncio.sleep(RECONCILE_INTERVAL_S)
        finally:
            pool.shutdown(wait=False, cancel_futures=True)

    async def _pass(self, pool: ThreadPoolExecutor) -> bool:
        """Read the store's intents on a worker thread (so a big store never stalls the iterations), apply
        them on the event loop, hand the jobs to prepare to `pool`, follow the dedicated runs. Whether
        anything was applied."""
        try:
            intents, pending = await asyncio.to_thread(self.read_intents, self.running)
            self.apply(intents)
            self._prepare_in(pool, pending)
            if self._dedicated is not None:
                await asyncio.to_thread(self._dedicated.poll)
                self.record_events()  # first: a released run's last checkpoint is among its events
                for job_id in self._dedicated.pop_gone():  # started again from its last checkpoint
                    self._running.pop(job_id, None)
        except Exception:  # noqa: BLE001 - the store or a runner failing as a whole: the next pass retries
            logger.exception("fine-tuning job reconcile failed")
            return False
        return bool(intents)

    def _prepare_in(self, pool: ThreadPoolExecutor, pending: list[JobRecord]) -> None:
        """Hand jobs to prepare to `pool`, oldest first: one per tenant at a time, `MAX_PREPARING` in all."""
        for record in pending:
            if len(self._preparing) >= MAX_PREPARING:
                return
            if record.tenant in self._preparing or record.id in self._prepared or record.id in self._running:
                continue
            self._preparing[record.tenant] = record.id
            pool.submit(self._prepare_for_tenant, record)

    def _prepare_for_tenant(self, record: JobRecord) -> None:
        try:
            self.prepare(record)
        finally:
            self._preparing.pop(record.tenant, None)

    def watch(self) -> None:
        """Write an event on each running job that stopped moving (saying why) or moved again, or whose
        sequence KV reclaim kept restarting."""
        for running in self._running.values():
            running.job = running.runner.get(running.record.id) or running.job
        progress = {job_id: r.job.progress_marker for job_id, r in self._running.items()
                    if r.job is not None and r.job.runnable}
        reasons = {job_id: why for job_id in progress
                   if (why := self._running[job_id].runner.held_back(job_id)) is not None}
        steps = {job_id: self._running[job_id].runner.plan_step(job_id) for job_id in progress}
        restarts = {job_id: job.sequence_restarts for job_id, r in self._running.items()
                    if (job := r.job) is not None}
        for notice in [*self.watchdog.check(progress, None, reasons, steps), *self.watchdog.check_restarts(restarts)]:
            if notice.stalled:
                logger.warning("fine-tuning job %s: %s", notice.job_id, notice.message)
            self._store.events.add(notice.job_id, notice.message)

    # -------------------------------------------------------------------------- policy -> store

    def record_events(self, engine_id: str | None = None) -> None:
        """Write the jobs' events (steps, checkpoints, success, failure) into the store (`JobEvents`); never
        raises: an event that cannot be recorded fails its own job. `engine_id`: the engine whose step the
        co-served events come from (trained tokens are counted on it; a dedicated run's on
        `DEDICATED_ENGINE_LABEL`)."""
        self._events.record(self._runners(), self._dedicated, engine_id, DEDICATED_ENGINE_LABEL)
