"""`DedicatedRun`: the driver of one dedicated fine-tuning run, a Ray actor around Ray Train's
`TorchTrainer`.

`start` runs `TorchTrainer(train_loop).fit()` on a thread of the actor (fit blocks until the run ends),
so the actor keeps answering: rank 0 of the workers `push`es the job's events after every step and gets
the command back (run, pause, stop, or release: a run paused too long saves a checkpoint and ends, its
workers given back); the job manager `poll`s what happened and `command`s. Ray Train does
the distribution: the placement of `workers` workers (one CPU each, or one GPU each), the process group
(gloo on CPU, NCCL on GPU), checkpoint persistence under the job's folder in the data dir, and recovery:
a worker that dies is replaced and the group restarts from the latest checkpoint, up to `max_failures`
times (`FailureConfig`); each failure is a note in the job's events.

The actor is owned by the scheduler actor that started it: when the scheduler goes (a server restart),
the run goes with it, and the new scheduler runs the job again from its last checkpoint.
"""

from __future__ import annotations

import threading
from typing import Any

from ray.train import UserCallback

from coserve.contract.dedicated_run import Command, RunSpec, RunUpdate, WorkerInfo
from coserve.contract.job_spec import JobEvent, JobEventKind

_TERMINAL = (JobEventKind.SUCCEEDED, JobEventKind.FAILED, JobEventKind.CANCELLED)


class DedicatedRun:
    """One job's Ray Train run (make it a threaded actor: `ray.remote(max_concurrency=...)`).

    Args:
        spec: what to train, where the checkpoints go, on how many workers.
    """

    def __init__(self, spec: RunSpec) -> None:
        self._spec = spec
        self._lock = threading.Lock()
        self._update = RunUpdate()
        self._workers: list[WorkerInfo] = []
        self._placement_group: str | None = None
        self._command = Command.RUN
        self._trained_tokens = 0
        self._ended = False  # a terminal event was reported
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the run (once) on a thread of this actor; returns at once."""
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._fit, name="dedicated-fit", daemon=True)
                self._thread.start()

    def _fit(self) -> None:
        import ray
        from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
        from ray.train.torch import TorchTrainer

        from coserve.dedicated.worker import train_loop

        spec = self._spec
        me = ray.get_runtime_context().current_actor
        resources = {"CPU": 1.0, "GPU": 1.0} if spec.use_gpu else {"CPU": 1.0}
        trainer = TorchTrainer(
            train_loop, train_loop_config={"spec": ray.put(spec), "control": me},
            scaling_config=ScalingConfig(num_workers=spec.workers, use_gpu=spec.use_gpu,
                                         resources_per_worker=resources),
            run_config=RunConfig(name=spec.run_name, storage_path=spec.storage_path,
                                 failure_config=FailureConfig(max_failures=spec.max_failures),
                                 # Every epoch's checkpoint is a servable model: Ray Train deletes none.
                                 checkpoint_config=CheckpointConfig(num_to_keep=None),
                                 callbacks=[_FailureNotes(me)]))
        try:
            trainer.fit()
            outcome = None
        except Exception as err:  # noqa: BLE001 - whatever ended the run, the job must say so
            outcome = _failure_text(err)
        self._end(outcome)

    def _end(self, failure: str | None) -> None:
        """The run is over: report its end unless a worker already did. A run released while paused ends
        without one (its workers saved a checkpoint first): the job goes on in a new run."""
        job, step = self._spec.job, 0
        with self._lock:
            if not self._ended and failure is None and self._command == Command.RELEASE:
                self._update.released = True
            elif not self._ended:
                if self._command == Command.STOP:
                    event = JobEvent(job.job_id, JobEventKind.CANCELLED, step, message="the job was cancelled")
                else:
                    event = JobEvent(job.job_id, JobEventKind.FAILED, step, code="training_failed",
                                     message=f"the Ray Train run failed: {failure or 'it ended without a result'}")
                self._update.events.append(event)
                self._ended = True
            self._update.done = True

    # ------------------------------------------------------------------------- from the workers

    def push(self, events: list[JobEvent], trained_tokens: int | None = None) -> int:
        """Rank 0's events since its last push (and the job's trained tokens so far); returns the
        `Command` every worker follows at this step boundary."""
        with self._lock:
            self._update.events.extend(events)
            self._ended = self._ended or any(e.kind in _TERMINAL for e in events)
            if trained_tokens is not None:
                self._trained_tokens = max(self._trained_tokens, trained_tokens)
            return int(self._command)

    def started(self, workers: list[WorkerInfo], note: str, placement_group: str | None = None) -> None:
        """The workers of an attempt are up (after a failure, their replacements), in `placement_group`."""
        with self._lock:
            self._workers, self._placement_group = list(workers), placement_group
            self._update.notes.append(note)

    def note(self, message: str) -> None:
        with self._lock:
            self._update.notes.append(message)

    # ------------------------------------------------------------------------- from the job manager

    def poll(self) -> tuple[RunUpdate, int]:
        """What happened since the last poll, and the job's trained tokens so far."""
        with self._lock:
            update, self._update = self._update, RunUpdate(done=self._update.done, released=self._update.released)
            update.workers, update.placement_group = list(self._workers), self._placement_group
            return update, self._trained_tokens

    def command(self, command: int) -> None:
        """Pause, resume (`RUN`), release (a checkpoint, then the workers go) or stop the run at its next
        step boundary. A stop is final; a release too, but for a stop (a cancel while it releases)."""
        wanted = Command(command)
        with self._lock:
            if self._command == Command.STOP or (self._command == Command.RELEASE and wanted != Command.STOP):
                return
            self._command = wanted


class _FailureNotes(UserCallback):  # type: ignore[misc]  # Ray Train is read as Any (pyproject.toml)
    """A Ray Train callback (run on the controller): each worker failure becomes a note in the job's
    events; Ray Train then restarts the workers from the latest checkpoint."""

    def __init__(self, control: Any) -> None:
        self._control = control

    def after_exception(self, run_context: Any, worker_exceptions: dict[int, Exception]) -> None:
        for rank, error in sorted(worker_exceptions.items()):
            self._control.note.remote(f"Ray Train worker {rank} failed ({_failure_text(error)}); Ray Train "
                                      f"restarts the workers from the latest checkpoint unless the run is "
                                      f"out of retries")


def _failure_text(err: BaseException) -> str:
    """The first line of an error, without Ray's tracebacks."""
    failures = getattr(err, "worker_failures", None)
    if failures:
        err = next(iter(failures.values()))
        cause = getattr(err, "cause", None)
        err = cause if isinstance(cause, BaseException) else err
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"[:500]


def launch(spec: RunSpec, name: str | None = None, namespace: str | None = None) -> Any:
    """Create the run's actor (named `name` in `namespace` when given) and start the run; returns its
    handle. The actor takes no CPU: the workers Ray Train places do the work."""
    import ray

    options: dict[str, Any] = {"num_cpus": 0, "max_concurrency": 8}
    if name is not None:
        options.update(name=name, namespace=namespace)
    handle = ray.remote(DedicatedRun).options(**options).remote(spec)
    handle.start.remote()
    return handle
