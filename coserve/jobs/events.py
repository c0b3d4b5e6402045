"""Policy -> store: what the running fine-tuning jobs did, written into the metadata store (on the scheduler's
event loop).

Metrics events per optimizer step (once per step: a resumed job redoes the steps after its checkpoint, and
its counters continue from the checkpoint's), checkpoints (registered as servable models
`ft:...:ckpt-step-N` the moment they exist), the final model, failures with their reason, cancellations.

A job's failure is the job's: an event that cannot be recorded (a bug, a value the store refuses) ends
that job with an `internal_error` (`abandon`), and the other jobs' events are recorded as usual; nothing
raises to the caller, whose step also carries other tenants' requests. A non-finite training loss at a step
is the job's divergence, which its settings or data caused: it fails with `non_finite_loss` saying so
(the store keeps only finite numbers; any other non-finite metric is stored as null).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from coserve.contract.data_position import DataPosition
from coserve.contract.job_runner import JobRunner, RunningJob
from coserve.contract.job_spec import JobEvent, JobEventKind
from coserve.jobs.failures import JobError, JobStage, failure, record_failure, storable, update_terminal
from coserve.jobs.storage import JobStorage
from coserve.store import MetadataStore
from coserve.store.records import JobRecord, JobStatus
from coserve.tenancy.storage_quota import QUOTA_CODES

logger = logging.getLogger(__name__)

# The codes of a job whose training diverged (a NaN/inf loss or gradient): caused by its own settings or data.
DIVERGED_CODES = frozenset({"non_finite_loss", "non_finite_gradient"})
DIVERGED_HINT = ("the job's training diverged, which its hyperparameters or data caused, not the server: "
                 "retry with a lower learning_rate_multiplier (or lora_alpha)")


@dataclass(slots=True)
class Running:
    """A job the policy runs, as the job manager keeps it."""

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


def model_id(base_model_id: str, record: JobRecord) -> str:
    """`ft:{base}:{tenant}:{suffix}:{job-suffix}` (the job id's random part, as OpenAI's last field)."""
    return f"ft:{base_model_id}:{record.tenant}:{record.suffix or ''}:{record.id[6:14]}"


def _finite(metrics: dict[str, Any]) -> dict[str, Any]:
    """`metrics` with every non-finite number as None (the store's JSON holds only finite ones)."""
    return {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in metrics.items()}


class JobEvents:
    """Records the running jobs' events and notices (module docstring).

    Args:
        store: the metadata store.
        base_model_id: the served base model's id (fine-tuned models are named after it).
        storage: the tenants' storage checks (a saved adapter over the quota is not kept).
        running: the job manager's running jobs by id (shared: an ended job leaves it here).
        clock: seconds (`estimated_finish`).
        on_trained: (tenant, trained tokens of a completed step, engine), for metrics.
    """

    def __init__(self, store: MetadataStore, base_model_id: str, storage: JobStorage, running: dict[str, Running],
                 clock: Callable[[], float], on_trained: Callable[[str, int, str], None] | None = None) -> None:
        self._store, self._base_model_id, self._storage = store, base_model_id, storage
        self._running, self._clock, self._on_trained = running, clock, on_trained

    def record(self, runners: list[JobRunner], dedicated: JobRunner | None, engine_label: str | None,
               dedicated_label: str) -> None:
        """Write the runners' notices and events; `engine_label`: the engine the co-served events come from
        (trained tokens are counted on it; a dedicated run's on `dedicated_label`)."""
        for runner in runners:
            for notice in runner.pop_notices():  # placed on an engine, waiting for one, moved
                if notice.job_id in self._running:
                    text = storable(notice.message[:1].upper() + notice.message[1:])
                    self._guarded(notice.job_id, partial(self._store.events.add, notice.job_id, text))
        for runner in runners:
            for event in runner.pop_events():
                running = self._running.get(event.job_id)
                if running is not None:
                    label = dedicated_label if running.runner is dedicated else engine_label
                    self._guarded(event.job_id, partial(self._handle, running, event, label))

    def _guarded(self, job_id: str, write: Callable[[], object]) -> None:
        try:
            write()
        except Exception as err:  # noqa: BLE001 - one job's event must not stop the others' (module docstring)
            self.abandon(job_id, err, JobStage.RECORDING)

    def abandon(self, job_id: str, err: Exception, stage: JobStage) -> None:
        """End a job something raised for: stop it where it runs (if it does) and fail it with `failure`."""
        logger.error("fine-tuning job %s failed while %s", job_id, stage.value, exc_info=err)
        running = self._running.pop(job_id, None)
        if running is not None:
            try:
                running.runner.cancel(job_id)  # its cancellation is not reported: it left `running`
            except Exception:  # noqa: BLE001 - the job is failed whatever its runner does
                logger.exception("fine-tuning job %s: stopping it in its runner failed", job_id)
        record_failure(self._store, job_id, failure(err, stage))

    def _handle(self, running: Running, event: JobEvent, engine_label: str | None) -> None:
        running.job = running.runner.get(event.job_id) or running.job  # a moved job is a new object
        if event.kind is JobEventKind.STEP:
            self._on_step(running, event, engine_label)
        else:
            _HANDLERS[event.kind](self, running, event)

    def _on_step(self, running: Running, event: JobEvent, engine_label: str | None) -> None:
        if event.loss is not None and not math.isfinite(event.loss):
            running.runner.cancel(event.job_id)  # stopped where it runs; its cancellation is not reported
            self._end(running, JobError("non_finite_loss", f"the training loss at step {event.step} is "
                                        f"{event.loss}: {DIVERGED_HINT}"))
            return
        running.last_loss, running.last_metrics = event.loss, _finite(event.metrics)
        if self._on_trained is not None and engine_label is not None:
            self._on_trained(running.record.tenant, event.num_tokens, engine_label)
        job = running.reported_job()
        data = {**running.last_metrics, "step": event.step, "train_loss": event.loss, "total_steps": job.total_steps}
        reward = data.get("train_reward_mean")
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

    def _keep_adapter(self, running: Running, event: JobEvent) -> bool:
        """Whether the adapter the engine saved fits the tenant's storage quota; if not, it is gone from
        disk and the job fails (stopped in the policy first, so its cancellation is not reported)."""
        refusal = self._storage.admit_saved(running.record.tenant, event.path)
        if refusal is None:
            return True
        running.runner.cancel(running.record.id)
        self._end(running, JobError(QUOTA_CODES[refusal.limit], f"the adapter saved at step {event.step} "
                                    f"was not kept: {refusal.reason}. Delete files or fine-tuned models to free space"))
        return False

    def _on_checkpoint(self, running: Running, event: JobEvent) -> None:
        if not self._keep_adapter(running, event):
            return
        record = running.record
        name = f"{model_id(self._base_model_id, record)}:ckpt-step-{event.step}"
        metrics = {**running.last_metrics, "step": event.step, "train_loss": running.last_loss}
        self._store.models.register(name, tenant=record.tenant, base_model=self._base_model_id,
                                    adapter_path=event.path, job_id=record.id)
        self._store.checkpoints.add(record.id, event.step, name, metrics=metrics, adapter_path=event.path)
        self._store.events.add(record.id, f"Checkpoint created at step {event.step}")

    def _on_validation(self, running: Running, event: JobEvent) -> None:
        job = running.reported_job()
        loss = None if event.loss is None or not math.isfinite(event.loss) else event.loss
        data: dict[str, Any] = {**_finite(event.metrics), "step": event.step, "total_steps": job.total_steps}
        if event.loss is not None:
            data["valid_loss"] = loss
        if running.last_loss is not None:
            data["train_loss"] = running.last_loss
        reward = data.get("valid_reward_mean")  # a reinforcement job's evaluation
        if event.loss is not None:
            what = f"loss={event.loss:.4g}"
        else:
            what = "reward=" + ("none" if reward is None else f"{reward:.4g}")
        self._store.events.add_once(event.job_id, f"validation-step-{event.step}",
                                    f"Step {event.step}/{job.total_steps}: validation {what}", type="metrics",
                                    data=data)

    def _on_succeeded(self, running: Running, event: JobEvent) -> None:
        if not self._keep_adapter(running, event):
            return
        record = running.record
        name = model_id(self._base_model_id, record)
        self._store.models.register(name, tenant=record.tenant, base_model=self._base_model_id,
                                    adapter_path=event.path, job_id=record.id)
        self._store.events.add(record.id, f"New fine-tuned model created: {name}")
        self._store.events.add(record.id, "The job has successfully completed")
        self._running.pop(record.id, None)
        update_terminal(self._store, record.id, status=JobStatus.SUCCEEDED, fine_tuned_model=name,
                        trained_tokens=running.reported_job().trained_tokens)

    def _on_failed(self, running: Running, event: JobEvent) -> None:
        code = event.code or "training_failed"
        message = f"{event.message}; {DIVERGED_HINT}" if code in DIVERGED_CODES else event.message
        self._end(running, JobError(code, storable(message)))

    def _on_cancelled(self, running: Running, event: JobEvent) -> None:
        self._running.pop(event.job_id, None)
        self._store.events.add(event.job_id, "Fine-tuning job cancelled")
        update_terminal(self._store, event.job_id, status=JobStatus.CANCELLED)

    def _end(self, running: Running, error: JobError) -> None:
        """The job failed with `error`: it leaves `running` (stopped where it runs by the caller, or ended there)."""
        self._running.pop(running.record.id, None)
        record_failure(self._store, running.record.id, error)


_HANDLERS: dict[JobEventKind, Callable[[JobEvents, Running, JobEvent], None]] = {
    JobEventKind.CHECKPOINT: JobEvents._on_checkpoint,
    JobEventKind.SUCCEEDED: JobEvents._on_succeeded,
    JobEventKind.FAILED: JobEvents._on_failed,
    JobEventKind.CANCELLED: JobEvents._on_cancelled,
    JobEventKind.VALIDATION: JobEvents._on_validation,
}
