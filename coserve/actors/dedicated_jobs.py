"""Dedicated fine-tuning jobs on the scheduler's side: the `JobManager`'s runner for jobs that train on
Ray Train instead of the shared engines.

`route_job` decides once, when a job's file is tokenized, whether it runs dedicated (it asked, or it is
over the operator's threshold: `coserve.policies.dedicated.route`) and keeps the decision in the job row.
`DedicatedJobs` starts each such job's `DedicatedRun` actor (named after the job, so a job manager
rebuilt after an engine restart finds the run still going and adopts it), relays cancel, pause and
resume as commands, and `poll`s the runs (on the job loop's worker thread): the runs' `JobEvent`s are
the co-served jobs' (steps, checkpoints, validation, success, failure, cancellation), so the job manager
records both kinds with the same handlers; the runs' notes (workers started, a worker failed) go to the
job's events as they are. A run whose actor died is reported `lost`: the job manager forgets it and
starts it again from its last checkpoint, as after a server restart.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from coserve.actors.job_failures import JobRefused
from coserve.actors.store import JobRecord, MetadataStore
from coserve.dedicated.contract import Command, RunSpec
from coserve.policies.dedicated import (TRAINING_KEY, DedicatedSettings, Route, TrainingMode, TrainingRequest,
                                        capacity_text, route)
from coserve.policies.finetune_types import FinetuneJobSpec, JobEvent, JobEventKind

logger = logging.getLogger(__name__)

RUN_NAMESPACE = "coserve"
POLL_TIMEOUT_S = 10.0


def is_dedicated(record: JobRecord) -> bool:
    """Whether the job row says the job runs on Ray Train."""
    return TrainingRequest.from_dict(record.extensions.get(TRAINING_KEY)).mode == TrainingMode.DEDICATED


def route_job(store: MetadataStore, record: JobRecord, trained_tokens: int,
              settings: DedicatedSettings | None) -> Route:
    """Decide how a newly tokenized job trains, keep it in the row (and say it in an event when the
    operator's threshold chose it).

    Raises:
        JobRefused: the job runs dedicated but this server has no Ray (`dedicated_training_unavailable`).
    """
    request = TrainingRequest.from_dict(record.extensions.get(TRAINING_KEY))
    decision = route(request, trained_tokens, settings)
    if decision.dedicated and settings is None:
        raise JobRefused("the job asks for a dedicated Ray Train run, and this server runs without Ray "
                         "(--local)", "dedicated_training_unavailable", "training.mode")
    if decision.dedicated and request.mode is None:
        extensions = {**record.extensions, TRAINING_KEY: {"mode": TrainingMode.DEDICATED.value,
                                                          "workers": decision.workers}}
        store.jobs.update(record.id, extensions=extensions)
        record.extensions = extensions
        store.events.add(record.id, f"Routed to a dedicated Ray Train run on {decision.workers} worker(s): "
                                    f"{decision.reason}")
    return decision


@dataclass(slots=True)
class DedicatedJob:
    """A dedicated job as the job manager sees it (what it reads of a running job: `spec`, `total_steps`,
    `trained_tokens`, `runnable`, `last_planned_step`)."""

    spec: FinetuneJobSpec
    handle: Any  # the DedicatedRun actor
    workers: int
    trained_tokens: int
    started: bool = False  # the workers are up
    paused: bool = False
    ended: bool = False
    progress: int = 0  # moves with every report: the watchdog's marker
    last_step: int = 0
    waiting: str = ""  # why the workers are not up yet (for the watchdog)
    checkpoints: set[int] = field(default_factory=set)  # steps whose checkpoint was reported

    @property
    def total_steps(self) -> int:
        return -(-len(self.spec.examples) // self.spec.batch_size) * self.spec.n_epochs

    @property
    def runnable(self) -> bool:
        return not self.paused and not self.ended

    @property
    def last_planned_step(self) -> int:
        return self.progress

    def held_back(self) -> str:
        if not self.started:
            return self.waiting or f"waiting for Ray Train to start {self.workers} worker(s)"
        return f"its Ray Train run ({self.workers} workers) is on step {self.last_step + 1}/{self.total_steps}"

    def keep(self, event: JobEvent) -> bool:
        """Whether to record `event`: a checkpoint reported again (its steps redone after a worker
        failure) is registered once."""
        if event.kind == JobEventKind.STEP:
            self.last_step = max(self.last_step, event.step)
        if event.kind != JobEventKind.CHECKPOINT:
            return True
        fresh = event.step not in self.checkpoints
        self.checkpoints.add(event.step)
        return fresh


class DedicatedJobs:
    """The dedicated runs of one job manager.

    Args:
        settings: the server's dedicated settings (workers, GPU or CPU, dtype, retries).
        store: where the runs' notes go.
        model: the base model folder; data_dir: the runs' checkpoints go to `{data_dir}/adapters/{job}/`.
    """

    def __init__(self, settings: DedicatedSettings, store: MetadataStore, model: str, data_dir: Path,
                 namespace: str = RUN_NAMESPACE) -> None:
        self._settings, self._store, self._model = settings, store, model
        self._data_dir, self._namespace = Path(data_dir).resolve(), namespace
        self._jobs: dict[str, DedicatedJob] = {}
        self._lock = threading.Lock()  # `_events` and `_lost`: filled by `poll` on a worker thread
        self._events: list[JobEvent] = []
        self._lost: list[tuple[str, str]] = []

    def __contains__(self, job_id: object) -> bool:
        return job_id in self._jobs

    # ------------------------------------------------------------------------- control (event loop)

    def start(self, record: JobRecord, spec: FinetuneJobSpec) -> DedicatedJob:
        """Start the job's run (or adopt the one still running under its name); returns the job."""
        import ray

        from coserve.dedicated.run import launch

        workers = TrainingRequest.from_dict(record.extensions.get(TRAINING_KEY)).workers \
            or self._settings.default_workers
        name = f"coserve-dedicated-{record.id}"
        try:
            handle, adopted = ray.get_actor(name, namespace=self._namespace), True
        except ValueError:  # no such actor: start a run
            storage = self._data_dir / "adapters" / record.id
            run = RunSpec(spec, self._model, self._settings.dtype, str(storage), _next_run_name(storage),
                          workers, self._settings.use_gpu, self._settings.max_failures)
            handle, adopted = launch(run, name, self._namespace), False
        job = DedicatedJob(spec, handle, workers, max(spec.start_trained_tokens, record.trained_tokens or 0))
        self._jobs[record.id] = job
        self._store.events.add(record.id, "Still training on Ray Train (the engine's restart did not stop it)"
                               if adopted else f"Training on Ray Train: a TorchTrainer of {workers} worker(s) "
                               f"of {self._settings.per_worker()}, outside the shared engines")
        return job

    def remove_job(self, job_id: str) -> bool:
        """Cancel: the run stops at its next step boundary; one whose workers are not up yet is ended
        now. The cancellation event follows."""
        import ray

        job = self._jobs.get(job_id)
        if job is None or job.ended:
            return False
        if job.started:
            job.handle.command.remote(int(Command.STOP))
            return True
        ray.kill(job.handle)
        job.ended = True
        self._jobs.pop(job_id)
        with self._lock:
            self._events.append(JobEvent(job_id, JobEventKind.CANCELLED, job.last_step,
                                         message="the job was cancelled"))
        return True

    def pause_job(self, job_id: str) -> bool:
        """Pause at the next step boundary; the workers wait there (they keep their resources)."""
        return self._command(job_id, Command.PAUSE, paused=True)

    def resume_job(self, job_id: str) -> bool:
        return self._command(job_id, Command.RUN, paused=False)

    def _command(self, job_id: str, command: Command, paused: bool) -> bool:
        job = self._jobs.get(job_id)
        if job is None or job.ended:
            return False
        job.paused = paused
        job.handle.command.remote(int(command))
        return True

    def pop_job_events(self) -> list[JobEvent]:
        with self._lock:
            events, self._events = self._events, []
        return events

    def pop_lost(self) -> list[tuple[str, str]]:
        """(job id, why) of the runs whose actor died since the last call."""
        with self._lock:
            lost, self._lost = self._lost, []
        return lost

    def held_back(self) -> dict[str, str]:
        """Why each dedicated job is not moving, for the watchdog."""
        return {job_id: job.held_back() for job_id, job in list(self._jobs.items())}

    # ------------------------------------------------------------------------- polling (any thread)

    def poll(self) -> None:
        """Collect every run's events and notes (a worker thread: it waits on the actors)."""
        import ray

        waiting = [job for job in self._jobs.values() if not job.started]
        free = ray.available_resources() if waiting else {}
        total = ray.cluster_resources() if waiting else {}
        for job_id, job in list(self._jobs.items()):
            try:
                update, trained = ray.get(job.handle.poll.remote(), timeout=POLL_TIMEOUT_S)
            except ray.exceptions.GetTimeoutError:
                continue  # busy; the next poll asks again
            except ray.exceptions.RayActorError as err:
                self._jobs.pop(job_id, None)
                with self._lock:
                    self._lost.append((job_id, str(err).splitlines()[0][:300]))
                continue
            self._absorb(job_id, job, update, trained, free, total)

    def _absorb(self, job_id: str, job: DedicatedJob, update: Any, trained: int,
                free: dict[str, float], total: dict[str, float]) -> None:
        import ray

        job.trained_tokens = max(job.trained_tokens, trained)
        job.started = job.started or bool(update.workers)
        if not job.started:
            job.waiting = (f"waiting for Ray Train to place {capacity_text(total, self._settings.per_worker(), job.workers)}"
                           f", of which {({k: free.get(k, 0.0) for k in self._settings.per_worker()})} are free")
        for note in update.notes:
            self._store.events.add(job_id, note)
        kept = [e for e in update.events if job.keep(e)]
        if update.notes or update.events:
            job.progress += 1
        with self._lock:
            self._events.extend(kept)
        if update.done:
            job.ended = True
            self._jobs.pop(job_id, None)
            ray.kill(job.handle)  # its name frees for a later run of the job


def _next_run_name(storage: Path) -> str:
    """`run-N`, one more than the runs the job's folder holds: each attempt (a restart resumes from the
    last checkpoint) gets a fresh Ray Train run folder, so no attempt restores another's snapshot."""
    runs = [p.name for p in storage.glob("run-*") if p.name[4:].isdigit()] if storage.is_dir() else []
    return f"run-{1 + max((int(name[4:]) for name in runs), default=0)}"
