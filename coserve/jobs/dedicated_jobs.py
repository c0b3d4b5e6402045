"""Dedicated fine-tuning jobs on the scheduler's side: the `JobManager`'s runner for jobs that train on
Ray Train instead of the shared engines.

`route_job` decides once, when a job's file is tokenized, whether it runs dedicated (it asked, or it is
over the operator's threshold: `coserve.finetune.dedicated.route`) and keeps the decision in the job row.
`DedicatedJobs` launches each such job's `DedicatedRun` actor once the cluster has its workers free
(until then the job waits, with an event saying for what and its place in the queue whenever that
changes), names it after the job (a job manager rebuilt after an engine restart finds the run still going
and adopts it), relays cancel, pause and resume as commands, and `poll`s the runs (on the job loop's worker
thread): the runs' `JobEvent`s are the co-served jobs' (steps, checkpoints, validation, success, failure,
cancellation), so the job manager records both kinds with the same handlers; the runs' notes (workers
started, a worker failed) go to the job's events as they are. A run paused longer than the server's pause
timeout is released: its workers save a checkpoint and end, giving their resources back, and resuming the
job starts a new run from that checkpoint. A run whose actor died, or that was released, is `gone`: the
job manager forgets it and starts it again from its last checkpoint (a released one once it is resumed),
as after a server restart. A run that cannot be launched, polled or heard (its actor raising, a report the
store refuses) fails its own job with an internal error; the other runs are launched and polled as usual.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from coserve.contract.dedicated_run import Command, RunSpec
from coserve.contract.job_request import TRAINING_KEY, JobRequest, TrainingMode, TrainingRequest
from coserve.contract.job_runner import JobNotice
from coserve.contract.job_spec import FinetuneJobSpec, JobEvent, JobEventKind
from coserve.finetune.dedicated import DedicatedSettings, Route, capacity, route
from coserve.finetune.dedicated_queue import RunQueue
from coserve.jobs.dedicated_job import DedicatedJob
from coserve.jobs.failures import INTERNAL_ERROR, JobRefused
from coserve.jobs.leftover_groups import LeftoverGroups
from coserve.store import JobRecord, MetadataStore

logger = logging.getLogger(__name__)

RUN_NAMESPACE = "coserve"
PLACEMENT_GROUP_KEY = "ray_placement_group"  # the job row's extension: its latest run's placement group
POLL_TIMEOUT_S = 10.0


def _request(record: JobRecord) -> JobRequest:
    return JobRequest.from_row(record.hyperparameters, record.method, record.extensions)


def _training(record: JobRecord) -> TrainingRequest:
    return _request(record).training


def is_dedicated(record: JobRecord) -> bool:
    """Whether the job row says the job runs on Ray Train."""
    return _training(record).mode == TrainingMode.DEDICATED


def route_job(store: MetadataStore, record: JobRecord, trained_tokens: int, settings: DedicatedSettings | None,
              decide: bool = True) -> Route:
    """How a tokenized job trains: decided when its file is first tokenized (`decide`) and kept in the row
    (with an event when the operator's threshold chose it); read back from the row on a resume.

    Raises:
        JobRefused: the job runs dedicated but this server has no Ray (`dedicated_training_unavailable`).
    """
    job = _request(record)
    request = job.training
    decision = route(request, trained_tokens, settings if decide else None)
    if decision.dedicated and settings is None:
        raise JobRefused("the job asks for a dedicated Ray Train run, and this server runs without Ray "
                         "(--local)", "dedicated_training_unavailable", "training.mode")
    if decision.dedicated and request.mode is None:
        routed = TrainingRequest(TrainingMode.DEDICATED, decision.workers)
        extensions = {**record.extensions, TRAINING_KEY: routed.to_dict()}
        store.jobs.update(record.id, extensions=extensions)
        record.extensions = extensions
        store.events.add(record.id, f"Routed to a dedicated Ray Train run on {decision.workers} worker(s): "
                                    f"{decision.reason}")
    return decision


class DedicatedJobs:
    """The dedicated runs of one job manager.

    A run is launched only when the cluster has its workers free (first come, first served): until then
    the job waits with events saying for what and its place in the queue, and cancelling it ends nothing
    on Ray. A run paused for `settings.pause_timeout_s` is released (a checkpoint, then its workers go);
    the job is `gone` until it is resumed, when it starts again from that checkpoint. A launched run's
    placement group is kept in the job row (`PLACEMENT_GROUP_KEY`): a run whose driver died (the scheduler
    restarted, or the run's actor was lost) leaves its placement group behind on a cluster without Ray's
    state API (Ray Train's own cleaner needs it); it is removed once its workers are gone
    (`LeftoverGroups`), before the job's next run can get their resources.

    Args:
        settings: the server's dedicated settings (workers, GPU or CPU, dtype, retries).
        store: where the runs' notes go.
        model: the base model folder; data_dir: the runs' checkpoints go to `{data_dir}/adapters/{job}/`.
        clock: seconds (monotonic), for the pause timeout.
    """

    def __init__(self, settings: DedicatedSettings, store: MetadataStore, model: str, data_dir: Path,
                 namespace: str = RUN_NAMESPACE, clock: Callable[[], float] = time.monotonic) -> None:
        self._settings, self._store, self._model = settings, store, model
        self._data_dir, self._namespace, self._clock = Path(data_dir).resolve(), namespace, clock
        self._jobs: dict[str, DedicatedJob] = {}
        self._lock = threading.Lock()  # `_events` and `_gone`: filled by `poll` on a worker thread
        self._events: list[JobEvent] = []
        self._gone: list[str] = []
        self._leftovers = LeftoverGroups()
        self._queue = RunQueue()  # the places the waiting runs' jobs were told

    def __contains__(self, job_id: object) -> bool:
        return job_id in self._jobs

    # ------------------------------------------------------------------------- control (event loop)

    def start(self, spec: FinetuneJobSpec) -> DedicatedJob:
        """Queue the job's run (launched by `poll` when its workers are free), or adopt the run still
        going under its name (a scheduler restarted meanwhile); returns the job.

        Raises:
            ValueError: the job is not in the store, or not ended here.
        """
        import ray

        record = self._store.jobs.get(spec.tenant, spec.job_id)
        if record is None or spec.job_id in self._jobs:
            raise ValueError(f"job {spec.job_id!r} is not in the store, or runs already")
        workers = _training(record).workers or self._settings.default_workers
        name, handle, run = _run_name(record.id), None, None
        try:
            handle = ray.get_actor(name, namespace=self._namespace)
        except ValueError:  # no such actor: a run to launch, after what a dead one left behind
            self._leftovers.add(record.extensions.get(PLACEMENT_GROUP_KEY))
            storage = self._data_dir / "adapters" / record.id
            run = RunSpec(spec, self._model, self._settings.dtype, str(storage), _next_run_name(storage),
                          workers, self._settings.use_gpu, self._settings.max_failures)
        job = DedicatedJob(spec, record.tenant, run, handle, workers,
                           max(spec.start_trained_tokens, record.trained_tokens or 0))
        self._jobs[record.id] = job
        self._store.events.add(record.id, "Still training on Ray Train (the engine's restart did not stop it)"
                               if handle is not None else f"Training on Ray Train: a TorchTrainer of {workers} "
                               f"worker(s) of {self._settings.per_worker()}, outside the shared engines")
        return job

    def cancel(self, job_id: str) -> bool:
        """Cancel: a queued run is dropped now; a launched one stops at its next step boundary (its workers
        end cleanly, giving their resources back). The cancellation event follows."""
        job = self._jobs.get(job_id)
        if job is None or job.ended:
            return False
        if job.handle is not None:
            job.handle.command.remote(int(Command.STOP))
            return True
        job.ended = True
        self._jobs.pop(job_id)
        with self._lock:
            self._events.append(JobEvent(job_id, JobEventKind.CANCELLED, job.last_step,
                                         message="the job was cancelled"))
        return True

    def pause(self, job_id: str) -> bool:
        """Pause at the next step boundary; the workers wait there, keeping their resources for up to the
        pause timeout (then `poll` releases them)."""
        return self._command(job_id, Command.PAUSE, paused=True)

    def resume(self, job_id: str) -> bool:
        return self._command(job_id, Command.RUN, paused=False)

    def _command(self, job_id: str, command: Command, paused: bool) -> bool:
        job = self._jobs.get(job_id)
        if job is None or job.ended:
            return False
        job.paused = paused
        job.paused_at = self._clock() if paused else None
        if job.handle is not None:
            job.handle.command.remote(int(command))
        return True

    def get(self, job_id: str) -> DedicatedJob | None:
        return self._jobs.get(job_id)

    def plan_step(self, job_id: str) -> int:
        return -1  # its run is on no engine

    def pop_events(self) -> list[JobEvent]:
        with self._lock:
            events, self._events = self._events, []
        return events

    def pop_notices(self) -> list[JobNotice]:
        return []  # what a run does is written as the job's events at once

    def pop_gone(self) -> list[str]:
        """The jobs whose run is gone since the last call, the job not ended (their event says so): its
        actor died, or it was released while paused. The job manager forgets them; its reconcile starts
        them again from their last checkpoint (at once, or once a paused job is resumed)."""
        with self._lock:
            gone, self._gone = self._gone, []
        return gone

    def held_back(self, job_id: str) -> str | None:
        """Why the job is not moving (waiting for workers, or where its run is), for the watchdog."""
        job = self._jobs.get(job_id)
        return None if job is None else job.held_back()

    # ------------------------------------------------------------------------- polling (any thread)

    def poll(self) -> None:
        """Launch the queued runs whose workers are free, then collect every run's events and notes (a
        worker thread: it waits on Ray)."""
        import ray

        self._leftovers.sweep()  # what dead runs hold, given back before the queued runs look for room
        self._launch_queued()
        self._release_overdue()
        for job_id, job in list(self._jobs.items()):
            if job.handle is None:
                continue
            try:
                update, trained = ray.get(job.handle.poll.remote(), timeout=POLL_TIMEOUT_S)
            except ray.exceptions.GetTimeoutError:
                continue  # busy; the next poll asks again
            except ray.exceptions.RayActorError as err:
                self._jobs.pop(job_id, None)
                self._leftovers.add(job.placement_group)
                self._store.events.add(job_id, f"The Ray Train run stopped ({str(err).splitlines()[0][:300]}); "
                                               f"the job resumes from its last checkpoint")
                with self._lock:
                    self._gone.append(job_id)
                continue
            except Exception as err:  # noqa: BLE001 - a job's failure is the job's: the other runs are polled
                self._fail_run(job_id, job, err)
                continue
            try:
                self._absorb(job_id, job, update, trained)
            except Exception as err:  # noqa: BLE001 - a report that cannot be taken in ends its own run only
                self._fail_run(job_id, job, err)

    def _fail_run(self, job_id: str, job: DedicatedJob, err: Exception) -> None:
        """A run that could not be launched, polled or heard: it is stopped and its job fails with an internal
        error (the job manager records it); the other runs go on."""
        import ray

        logger.error("dedicated job %s: its Ray Train run failed", job_id, exc_info=err)
        self._jobs.pop(job_id, None)
        job.ended = True
        if job.handle is not None:
            try:
                ray.kill(job.handle)
            except Exception:  # noqa: BLE001 - the job fails whatever is left of its run
                logger.exception("dedicated job %s: stopping its run failed", job_id)
        self._leftovers.add(job.placement_group)
        with self._lock:
            self._events.append(JobEvent(job_id, JobEventKind.FAILED, job.last_step, code=INTERNAL_ERROR,
                                         message=f"its Ray Train run failed on an internal error "
                                                 f"({type(err).__name__}); the server's log has the details"))

    def _launch_queued(self) -> None:
        """First come, first served: launch queued runs while the cluster has their workers free; the
        first that does not fit and every run behind it wait (no overtaking), each told its place."""
        import ray

        from coserve.dedicated.run import launch

        queued = [(job_id, job) for job_id, job in self._jobs.items() if job.run is not None and not job.paused]
        waiting: list[str] = []
        if queued:
            free, total = ray.available_resources(), ray.cluster_resources()
            per_worker = self._settings.per_worker()
            for job_id, job in queued:
                if waiting or capacity(free, per_worker) < job.workers:
                    waiting.append(job_id)
                    continue
                assert job.run is not None  # queued: not launched yet
                try:
                    job.handle = launch(job.run, _run_name(job_id), self._namespace)
                except Exception as err:  # noqa: BLE001 - a job's failure is the job's: the others launch
                    self._fail_run(job_id, job, err)
                    continue
                job.run, job.waiting = None, ""
                free = {k: v - per_worker.get(k, 0.0) * job.workers for k, v in free.items()}
            if waiting:
                self._wait_first(waiting[0], free, total)
        self._tell_places(waiting)

    def _wait_first(self, job_id: str, free: dict[str, float], total: dict[str, float]) -> None:
        """The first waiting run: what it waits for (an event when it becomes first)."""
        job, per_worker = self._jobs[job_id], self._settings.per_worker()
        now_free = {k: free.get(k, 0.0) for k in per_worker}
        why = (f"waiting for {job.workers} free worker(s) of {per_worker}: the cluster has "
               f"{ {k: total.get(k, 0.0) for k in per_worker} }, {now_free} of it free (other work "
               f"holds the rest)")
        if not job.waiting.startswith("waiting for"):
            self._store.events.add(job_id, why[0].upper() + why[1:])
        job.waiting = why

    def _tell_places(self, waiting: list[str]) -> None:
        """Each waiting run's place in the queue: an event when it joins or moves; the runs behind the
        first say so to the watchdog."""
        for place in self._queue.update(waiting):
            words = place.words()
            self._store.events.add(place.job_id, words[0].upper() + words[1:])
            if place.position > 1:
                self._jobs[place.job_id].waiting = f"{words}, behind {place.position - 1} run(s) waiting for workers"

    def _release_overdue(self) -> None:
        """Release the runs paused for the pause timeout: each saves a checkpoint at its step boundary and
        ends, its workers given back (`_absorb` forgets it then)."""
        now = self._clock()
        for job in self._jobs.values():
            if job.release_due(now, self._settings.pause_timeout_s):
                job.releasing = True
                job.handle.command.remote(int(Command.RELEASE))

    def _absorb(self, job_id: str, job: DedicatedJob, update: Any, trained: int) -> None:
        import ray

        job.trained_tokens = max(job.trained_tokens, trained)
        job.started = job.started or bool(update.workers)
        if update.placement_group and update.placement_group != job.placement_group:
            job.placement_group = update.placement_group
            self._keep_placement_group(job_id, job)
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
            ray.kill(job.handle)  # its workers are gone (fit returned); its name frees for a later run
            if update.released:
                self._store.events.add(job_id, f"Paused for {self._settings.pause_timeout_s:g} s: the Ray Train "
                                               f"run gave its {job.workers} worker(s) back; resuming the job "
                                               f"restarts it from {job.resume_point()}")
                with self._lock:
                    self._gone.append(job_id)

    def _keep_placement_group(self, job_id: str, job: DedicatedJob) -> None:
        record = self._store.jobs.get(job.tenant, job_id)
        if record is not None and not record.status.is_terminal:
            self._store.jobs.update(job_id, extensions={**record.extensions,
                                                        PLACEMENT_GROUP_KEY: job.placement_group})


def _run_name(job_id: str) -> str:
    return f"coserve-dedicated-{job_id}"


def _next_run_name(storage: Path) -> str:
    """`run-N`, one more than the runs the job's folder holds: each attempt (a restart resumes from the
    last checkpoint) gets a fresh Ray Train run folder, so no attempt restores another's snapshot."""
    runs = [p.name for p in storage.glob("run-*") if p.name[4:].isdigit()] if storage.is_dir() else []
    return f"run-{1 + max((int(name[4:]) for name in runs), default=0)}"
