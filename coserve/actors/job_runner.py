"""`JobRunner`: where the job manager's co-served jobs run, one engine's `JobHost` or the jobs of
several engines (`ClusterJobs`), behind one surface.

The job manager starts a job from its spec and lets the runner build it where it goes: on the one
engine (`HostJobs`), or on the engine the cluster places it on (`ClusterJobRunner`), where it may later
move (its engine lost) and resume from its last checkpoint. So the manager asks for a job's current
object (`get_job`) rather than keeping the one it started, and writes the runner's notices (placed,
waiting for an engine and why, moved) as job events.
"""

from __future__ import annotations

from typing import Protocol

from coserve.cluster.jobs import ClusterJobs, JobNotice
from coserve.finetune.job import FinetuneJob
from coserve.contract.job_spec import FinetuneJobSpec, JobEvent
from coserve.finetune.host import JobHost


class JobRunner(Protocol):
    """What the job manager asks of the engines' side of its co-served jobs."""

    def start_job(self, spec: FinetuneJobSpec) -> None:
        """Build and schedule the job (it may wait for an engine: a notice says why)."""

    def remove_job(self, job_id: str) -> bool:
        """Cancel (its end is reported as an event); False when unknown."""

    def pause_job(self, job_id: str) -> bool: ...

    def resume_job(self, job_id: str) -> bool: ...

    def get_job(self, job_id: str) -> FinetuneJob | None:
        """The job's current object; None when it waits for an engine or has ended."""

    def held_back(self, job_id: str) -> str | None:
        """Why the job got no work lately (None: it did, or unknown)."""

    def plan_step(self, job_id: str) -> int:
        """Step id of the last plan of the job's engine (-1: none, or the job is not placed)."""

    def pop_job_events(self) -> list[JobEvent]: ...

    def pop_notices(self) -> list[JobNotice]:
        """What the runner did with jobs that their own events do not say, since the last call."""


class HostJobs:
    """One engine's jobs: its policy's `JobHost` (jobs never move).

    Args:
        host: the engine policy's job host.
    """

    def __init__(self, host: JobHost) -> None:
        self._host = host

    def start_job(self, spec: FinetuneJobSpec) -> None:
        self._host.add_job(FinetuneJob(spec, self._host.kv, self._host.adapters))

    def remove_job(self, job_id: str) -> bool:
        return self._host.remove_job(job_id)

    def pause_job(self, job_id: str) -> bool:
        return self._host.pause_job(job_id)

    def resume_job(self, job_id: str) -> bool:
        return self._host.resume_job(job_id)

    def get_job(self, job_id: str) -> FinetuneJob | None:
        job = self._host.get_job(job_id)
        return job if isinstance(job, FinetuneJob) else None

    def held_back(self, job_id: str) -> str | None:
        return self._host.finetune_held_back

    def plan_step(self, job_id: str) -> int:
        return self._host.roster.last_plan_step

    def pop_job_events(self) -> list[JobEvent]:
        return self._host.pop_job_events()

    def pop_notices(self) -> list[JobNotice]:
        return []


class ClusterJobRunner:
    """The jobs of several engines (`ClusterJobs`: placed by memory and load, checkpoints published to
    every engine, moved when their engine is lost).

    Args:
        jobs: the cluster scheduler's jobs.
    """

    def __init__(self, jobs: ClusterJobs) -> None:
        self._jobs = jobs

    def start_job(self, spec: FinetuneJobSpec) -> None:
        self._jobs.start(spec)

    def remove_job(self, job_id: str) -> bool:
        return self._jobs.cancel(job_id)

    def pause_job(self, job_id: str) -> bool:
        return self._jobs.pause(job_id)

    def resume_job(self, job_id: str) -> bool:
        return self._jobs.resume(job_id)

    def get_job(self, job_id: str) -> FinetuneJob | None:
        return self._jobs.get(job_id)

    def held_back(self, job_id: str) -> str | None:
        return self._jobs.held_back(job_id)

    def plan_step(self, job_id: str) -> int:
        return self._jobs.plan_step(job_id)

    def pop_job_events(self) -> list[JobEvent]:
        return self._jobs.pop_events()

    def pop_notices(self) -> list[JobNotice]:
        return self._jobs.pop_notices()
