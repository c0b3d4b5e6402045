"""A dedicated fine-tuning job as the job manager sees it (`dedicated_jobs.DedicatedJobs` keeps them): its run
to launch or its Ray actor, its progress for the watchdog, why it is not moving, when a paused run is due
to be released, and which of its reports to record."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from coserve.contract.dedicated_run import RunSpec
from coserve.contract.job_runner import SequenceRestarts
from coserve.contract.job_spec import FinetuneJobSpec, JobEvent, JobEventKind


@dataclass(slots=True)
class DedicatedJob:
    """A dedicated job as the job manager sees it (what it reads of a running job: `spec`, `total_steps`,
    `trained_tokens`, `runnable`, `last_planned_step`)."""

    spec: FinetuneJobSpec
    tenant: str
    run: RunSpec | None  # to launch once the cluster has its workers free (None: launched or adopted)
    handle: Any  # the DedicatedRun actor (None until launched)
    workers: int
    trained_tokens: int
    started: bool = False  # the workers are up
    paused: bool = False
    ended: bool = False
    progress: int = 0  # moves with every report: the watchdog's marker
    last_step: int = 0
    waiting: str = ""  # why the run is not launched or its workers not up yet (for the watchdog)
    placement_group: str | None = None  # the run's Ray placement group (hex id), once its workers are up
    checkpoints: set[int] = field(default_factory=set)  # steps whose checkpoint was reported
    paused_at: float | None = None  # when it was paused (the clock of `DedicatedJobs`); None: not paused
    releasing: bool = False  # paused too long: told to save a checkpoint and give its workers back

    @property
    def total_steps(self) -> int:
        return -(-len(self.spec.examples) // self.spec.batch_size) * self.spec.n_epochs

    @property
    def runnable(self) -> bool:
        return not self.paused and not self.ended

    @property
    def last_planned_step(self) -> int:
        return self.progress

    @property
    def progress_marker(self) -> int:
        return self.progress

    @property
    def sequence_restarts(self) -> SequenceRestarts:
        return SequenceRestarts()  # its workers hold their own memory: nothing reclaims it

    def held_back(self) -> str:
        if not self.started:
            return self.waiting or f"Ray Train is starting {self.workers} worker(s)"
        return f"its Ray Train run ({self.workers} workers) is on step {self.last_step + 1}/{self.total_steps}"

    def release_due(self, now: float, timeout_s: float) -> bool:
        """Whether its launched run has been paused `timeout_s` or longer and is not released yet."""
        return (self.handle is not None and self.paused_at is not None and not self.releasing
                and not self.ended and now - self.paused_at >= timeout_s)

    def resume_point(self) -> str:
        """Where a new run of the job starts: its last checkpoint's step, or the start."""
        if self.checkpoints:
            return f"its checkpoint at step {max(self.checkpoints)}"
        start = self.spec.start_position
        return f"its checkpoint at step {start.step}" if self.spec.resume_from and start else "the start"

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
