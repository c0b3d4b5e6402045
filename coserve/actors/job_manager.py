"""Fine-tuning jobs on the scheduler's side: the metadata store says what should run, the policy runs it.

The gateway only writes intents into the store (a new job in `validating_files`, `cancelled`,
`paused`, `queued` again on resume). `JobManager.reconcile`, called by the scheduler's loop, brings
the policy in line with them: it validates and tokenizes new jobs, starts queued ones, pauses,
resumes and cancels, and after a restart resumes `running` jobs from their last checkpoint. The
store is the source of truth, so a restart and a normal start take the same path.
`JobManager.record_events` writes what the jobs did back: metrics events per optimizer step (once per
step: a resumed job redoes the steps after its checkpoint, and its counters continue from the checkpoint's),
checkpoints (registered as servable models `ft:...:ckpt-step-N` the moment they exist), the final
model, failures with their reason.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from coserve.actors.dedicated_jobs import DedicatedJobs, is_dedicated
from coserve.actors.job_failures import failure
from coserve.actors.job_preparation import FineTuningSettings, JobPreparation
from coserve.actors.job_resume import resume_spec
from coserve.actors.job_storage import JobStorage
from coserve.actors.job_watchdog import JobWatchdog
from coserve.contract.data_position import DataPosition
from coserve.contract.job_runner import JobRunner, RunningJob
from coserve.contract.job_spec import JobEvent, JobEventKind
from coserve.contract.messages import AdapterSpec
from coserve.frontend.job_prep import PreparedJob
from coserve.store import MetadataStore
from coserve.store.records import JobRecord, JobStatus
from coserve.tenancy.quotas import TenantLimits
from coserve.tenancy.storage_quota import QUOTA_CODES

logger = logging.getLogger(__name__)

# The `engine` label of the tokens dedicated Ray Train runs train (they run on no engine).
DEDICATED_ENGINE_LABEL = "dedicated"
# How often the job loop looks for new, paused, resumed or cancelled fine-tuning jobs in the store.
RECONCILE_INTERVAL_S = 0.25


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


@dataclass(slots=True)
class _Running:
    record: JobRecord
    runner: JobRunner  # where it runs: the engines (co-served), or a Ray Train run of its own
    job: RunningJob | None  # its latest object (a moved job gets a new one); None: waiting
    started_at: float
    last_loss: float | None = None
    last_metrics: dict[str, float] = field(default_factory=dict)  # a DPO step's rewards

    def reported_job(self) -> RunningJob:
        """`job`, for an event the job reported (a step, a validation, its end): its runner had it then."""
        if self.job is None:
            raise RuntimeError(f"fine-tuning job {self.record.id} reported an event its runner has no job for")
        return self.job


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


def model_id(settings: FineTuningSettings, record: JobRecord) -> str:
    """`ft:{base}:{tenant}:{suffix}:{job-suffix}` (the job id's random part, as OpenAI's last field)."""
    return f"ft:{settings.base_model_id}:{record.tenant}:{record.suffix or ''}:{record.id[6:14]}"


class JobManager:
    """Keeps the policy's jobs in line with the store; see the module docstring."""

    def __init__(self, store: MetadataStore, coserved: JobRunner, tokenizer: Any,
                 settings: FineTuningSettings, limits: Mapping[str, TenantLimits] | None = None,
                 clock: Callable[[], float] = time.time,
                 on_trained: Callable[[str, int, str], None] | None = None,
                 dedicated: DedicatedJobs | None = None) -> None:
        self._store, self._coserved, self._tokenizer = store, coserved, tokenizer
        self._settings, self._limits, self._clock = settings, dict(limits or {}), clock
        self._on_trained = on_trained  # (tenant, trained tokens of a completed step, engine), for metrics
        self._running: dict[str, _Running] = {}  # touched on the event loop only
        self._prepared: dict[str, PreparedJob] = {}  # validated, not yet started (collect's thread)
        self.watchdog = JobWatchdog(settings.stall_after_s)
        self._storage = JobStorage(store, self._limits)
        self._preparation = JobPreparation(store, tokenizer, settings, self._limits, self._storage)
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
        """Apply the store's intents now (`collect` then `apply` on the calling thread)."""
        self.apply(self.collect(self.running))

    def collect(self, running: Mapping[str, str]) -> list[Intent]:
        """Read the store's intents; validate and tokenize new jobs. Any thread.

        The slow part (tokenizing a training file) runs here, off the scheduler's event loop, with
        this manager's own tokenizer; it writes only to the store (which locks). `running`: the jobs
        the policy runs, as `running` returned them on the loop.
        """
        intents: list[Intent] = []
        for record in self._store.jobs.active():
            if record.status == JobStatus.VALIDATING_FILES:
                self._validate(record)
            elif record.id not in running and record.status in (JobStatus.QUEUED, JobStatus.RUNNING):
                intents.extend(self._start_intent(record))
            elif record.id in running and record.status in (JobStatus.PAUSED, JobStatus.QUEUED):
                intents.append(Intent(record, None))
        for job_id, tenant in running.items():
            current = self._store.jobs.get(tenant, job_id)
            if current is None or current.status == JobStatus.CANCELLED:
                intents.append(Intent(current, None, cancel_id=job_id))
        return intents

    def apply(self, intents: list[Intent]) -> None:
        """Hand the collected intents to the runners. On the scheduler's event loop only."""
        for intent in intents:
            running = self._running.get(intent.job_id)
            if intent.cancel_id is not None:
                if running is not None:
                    running.runner.cancel(intent.job_id)  # it reports the cancellation
                continue
            record = intent.record
            assert record is not None  # only a cancellation may lack the record
            if intent.prepared is not None:
                if running is None:
                    self._start(record, intent.prepared)
            elif running is None:
                continue  # it ended meanwhile
            elif record.status == JobStatus.PAUSED and running.record.status != JobStatus.PAUSED:
                running.runner.pause(intent.job_id)
                running.record = record
            elif record.status == JobStatus.QUEUED:  # resumed
                running.runner.resume(intent.job_id)
                running.record = self._store.jobs.update(intent.job_id, status=JobStatus.RUNNING)

    def _runners(self) -> list[JobRunner]:
        return [self._coserved] + ([] if self._dedicated is None else [self._dedicated])

    def _validate(self, record: JobRecord) -> None:
        """Tokenize the training file and resolve "auto": queued, or failed with the reason."""
        try:
            self._prepared[record.id] = self._preparation.prepare(record)
        except ValueError as err:
            code, param = failure(err)
            self._fail(record, code, str(err), param=param)
            return
        self._store.events.add(record.id, "Validated the training file")
        self._store.jobs.update(record.id, status=JobStatus.QUEUED)

    def _start_intent(self, record: JobRecord) -> list[Intent]:
        """A queued job's spec (tokenized again after a restart), resuming from its last checkpoint
        when it has one."""
        prepared = self._prepared.pop(record.id, None)
        try:
            prepared = prepared or self._preparation.prepare(record, resume=True)
        except ValueError as err:
            code, param = failure(err)
            self._fail(record, code, str(err), param=param)
            return []
        prepared.spec = resume_spec(self._store, record, prepared.spec)
        return [Intent(record, prepared)]

    def _start(self, record: JobRecord, prepared: PreparedJob) -> None:
        """Hand a job to its runner (on the event loop)."""
        dedicated = self._dedicated is not None and is_dedicated(record)
        runner: JobRunner = self._dedicated if dedicated else self._coserved  # type: ignore[assignment]
        runner.start(prepared.spec)
        job = runner.get(record.id)  # None: it waits for an engine (a notice says why)
        record = self._store.jobs.update(record.id, status=JobStatus.RUNNING)
        self._running[record.id] = _Running(record, runner, job, self._clock())
        resumed = prepared.spec.resume_from is not None
        self._store.events.add(record.id, "Resumed from the last checkpoint" if resumed
                               else "Fine-tuning job started")

    def _fail(self, record: JobRecord, code: str, message: str, param: str | None = None) -> None:
        """Record a failure (from either thread: `_running` entries are removed by the caller)."""
        self._store.events.add(record.id, f"Job failed: {message}", level="error")
        self._update_terminal(record.id, status=JobStatus.FAILED,
                              error={"code": code, "message": message, "param": param})

    def _update_terminal(self, job_id: str, **fields: Any) -> None:
        """A final status, unless the job is already final (e.g. cancelled by its tenant meanwhile)."""
        try:
            self._store.jobs.update(job_id, **fields)
        except ValueError:
            pass  # an illegal transition out of a terminal status: the first final word stands

    async def run(self, wake: Callable[[], None], stopped: Callable[[], bool]) -> None:
        """The scheduler's job loop: every `RECONCILE_INTERVAL_S`, `collect` on a worker thread (so
        tokenizing a training file never stalls the iterations), then `apply` on the event loop;
        `wake()` the scheduler when something changed."""
        while not stopped():
            try:
                intents = await asyncio.to_thread(self.collect, self.running)
                self.apply(intents)
                if self._dedicated is not None:
                    await asyncio.to_thread(self._dedicated.poll)
                    self.record_events()  # first: a released run's last checkpoint is among its events
                    for job_id in self._dedicated.pop_gone():  # started again from its last checkpoint
                        self._running.pop(job_id, None)
            except Exception:  # noqa: BLE001 - a bad job must not stop the others' reconciling
                logger.exception("fine-tuning job reconcile failed")
                intents = []
            if intents:
                wake()
            self.watch()
            await asyncio.sleep(RECONCILE_INTERVAL_S)

    def watch(self) -> None:
        """Write an event on each running job that stopped moving (saying why) or moved again, or whose
        sequence KV reclaim kept restarting."""
        for job_id, running in self._running.items():
            running.job = self._current(job_id, running)
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
        """Write the jobs' events (steps, checkpoints, success, failure) into the store; `engine_id`: the
        engine whose step the co-served events come from (trained tokens are counted on it; a dedicated
        run's on `DEDICATED_ENGINE_LABEL`)."""
        for runner in self._runners():
            for notice in runner.pop_notices():  # placed on an engine, waiting for one, moved
                if notice.job_id in self._running:
                    self._store.events.add(notice.job_id, notice.message[:1].upper() + notice.message[1:])
        for runner in self._runners():
            for event in runner.pop_events():
                running = self._running.get(event.job_id)
                if running is None:
                    continue
                running.job = self._current(event.job_id, running)
                if event.kind is JobEventKind.STEP:
                    dedicated = running.runner is self._dedicated
                    self._on_step(running, event, DEDICATED_ENGINE_LABEL if dedicated else engine_id)
                else:
                    _HANDLERS[event.kind](self, running, event)

    def _current(self, job_id: str, running: _Running) -> RunningJob | None:
        """The job's latest object: a co-served job moved to another engine is a new one; an ended job
        keeps its last (its end's event still reads it)."""
        return running.runner.get(job_id) or running.job

    def _on_step(self, running: _Running, event: JobEvent, engine_id: str | None) -> None:
        running.last_loss, running.last_metrics = event.loss, event.metrics
        if self._on_trained is not None and engine_id is not None:
            self._on_trained(running.record.tenant, event.num_tokens, engine_id)
        job = running.reported_job()
        data = {**event.metrics, "step": event.step, "train_loss": event.loss, "total_steps": job.total_steps}
        reward = event.metrics.get("train_reward_mean")
        rewarded = "" if reward is None else f", reward={reward:.4g}"
        stored = self._store.events.add_once(
            event.job_id, f"step-{event.step}",
            f"Step {event.step}/{job.total_steps}: training loss={event.loss:.4g}{rewarded}", type="metrics",
            data=data)
        if stored is None:
            # A step after the last checkpoint, redone by a resumed job: recorded before the restart,
            # with these counters (a rerun of a step trains the same tokens); the count never goes back.
            return
        elapsed = self._clock() - running.started_at
        steps_done = max(1, event.step - (job.spec.start_position or DataPosition(0)).step)
        remaining = (job.total_steps - event.step) * elapsed / steps_done
        self._store.jobs.update(event.job_id, trained_tokens=job.trained_tokens,
                                estimated_finish=int(self._clock() + remaining))

    def _keep_adapter(self, running: _Running, event: JobEvent) -> bool:
        """Whether the adapter the engine saved fits the tenant's storage quota; if not, it is gone from
        disk and the job fails (stopped in the policy first, so its cancellation is not reported)."""
        refusal = self._storage.admit_saved(running.record.tenant, event.path)
        if refusal is None:
            return True
        del self._running[running.record.id]
        running.runner.cancel(running.record.id)
        self._fail(running.record, QUOTA_CODES[refusal.limit], f"the adapter saved at step {event.step} "
                   f"was not kept: {refusal.reason}. Delete files or fine-tuned models to free space")
        return False

    def _on_checkpoint(self, running: _Running, event: JobEvent) -> None:
        if not self._keep_adapter(running, event):
            return
        record = running.record
        name = f"{model_id(self._settings, record)}:ckpt-step-{event.step}"
        metrics = {**running.last_metrics, "step": event.step, "train_loss": running.last_loss}
        self._store.models.register(name, tenant=record.tenant, base_model=self._settings.base_model_id,
                                    adapter_path=event.path, job_id=record.id)
        self._store.checkpoints.add(record.id, event.step, name, metrics=metrics,
                                    adapter_path=event.path)
        self._store.events.add(record.id, f"Checkpoint created at step {event.step}")

    def _on_validation(self, running: _Running, event: JobEvent) -> None:
        job = running.reported_job()
        data: dict[str, Any] = {**event.metrics, "step": event.step, "total_steps": job.total_steps}
        if event.loss is not None:
            data["valid_loss"] = event.loss
        if running.last_loss is not None:
            data["train_loss"] = running.last_loss
        reward = event.metrics.get("valid_reward_mean")  # a reinforcement job's evaluation
        what = f"loss={event.loss:.4g}" if event.loss is not None else f"reward={reward:.4g}"
        self._store.events.add_once(event.job_id, f"validation-step-{event.step}",
                                    f"Step {event.step}/{job.total_steps}: validation {what}", type="metrics",
                                    data=data)

    def _on_succeeded(self, running: _Running, event: JobEvent) -> None:
        if not self._keep_adapter(running, event):
            return
        record = running.record
        name = model_id(self._settings, record)
        self._store.models.register(name, tenant=record.tenant, base_model=self._settings.base_model_id,
                                    adapter_path=event.path, job_id=record.id)
        self._store.events.add(record.id, f"New fine-tuned model created: {name}")
        self._store.events.add(record.id, "The job has successfully completed")
        self._update_terminal(record.id, status=JobStatus.SUCCEEDED, fine_tuned_model=name,
                              trained_tokens=running.reported_job().trained_tokens)
        del self._running[record.id]

    def _on_failed(self, running: _Running, event: JobEvent) -> None:
        self._fail(running.record, event.code or "training_failed", event.message)
        del self._running[running.record.id]

    def _on_cancelled(self, running: _Running, event: JobEvent) -> None:
        self._store.events.add(event.job_id, "Fine-tuning job cancelled")
        self._update_terminal(event.job_id, status=JobStatus.CANCELLED)
        del self._running[event.job_id]


_HANDLERS = {
    JobEventKind.CHECKPOINT: JobManager._on_checkpoint,
    JobEventKind.SUCCEEDED: JobManager._on_succeeded,
    JobEventKind.FAILED: JobManager._on_failed,
    JobEventKind.CANCELLED: JobManager._on_cancelled,
    JobEventKind.VALIDATION: JobManager._on_validation,
}
