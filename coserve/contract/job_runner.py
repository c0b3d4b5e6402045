"""`JobRunner`: where fine-tuning jobs run, one vocabulary for all of them.

The job manager (the store's jobs -> where they run) speaks to three runners the same way:
`finetune.host.JobHost` (one engine's jobs: the offline `LLM`, and inside every engine's policy),
`cluster.jobs.ClusterJobs` (the server's co-served jobs, placed on one of its engines, one engine or
many) and `jobs.dedicated_jobs.DedicatedJobs` (jobs on Ray Train runs of their own). Each starts a
job from its spec, cancels, pauses and resumes it, hands out its events (steps, checkpoints, ends) and
its notices (what the runner did with a job that its events do not say: placed, waiting, moved), and
says why a job got no work lately.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from coserve.contract.job_spec import FinetuneJobSpec, JobEvent


@dataclass(frozen=True, slots=True)
class JobNotice:
    """Something a runner did with a job that its own events do not say (placed, waiting, moved)."""

    job_id: str
    engine_id: str | None
    message: str


@dataclass(frozen=True, slots=True)
class SequenceRestarts:
    """A job's sequences that KV reclaim dropped and restarted from their first token too often: each was
    dropped `coserve.finetune.sequence_kv.MAX_DROPS` times in a row, and then kept its KV blocks."""

    kept: int = 0  # such sequences so far
    tokens: int = 0  # the tokens of the last one


class RunningJob(Protocol):
    """What the job manager reads of a job where it runs."""

    @property
    def spec(self) -> FinetuneJobSpec: ...

    @property
    def total_steps(self) -> int: ...

    @property
    def trained_tokens(self) -> int: ...

    @property
    def runnable(self) -> bool: ...

    @property
    def last_planned_step(self) -> int:
        """Step id of the last plan that gave the job work."""

    @property
    def progress_marker(self) -> int:
        """Grows whenever the job gets further (work that stays done, its rollouts): the watchdog's marker."""

    @property
    def sequence_restarts(self) -> SequenceRestarts:
        """Its sequences restarted too often by KV reclaim (the watchdog says so in an event)."""


class JobRunner(Protocol):
    """Where jobs run (module docstring). Control takes effect at the runner's next step; a job that
    ends says so with an event."""

    def start(self, spec: FinetuneJobSpec) -> object:
        """Start the job (it may wait, for an engine or for workers: a notice or `held_back` says why).

        Raises:
            ValueError: a job with this id has not ended.
        """

    def cancel(self, job_id: str) -> bool:
        """Cancel; its end is reported as an event. False when unknown or ended."""

    def pause(self, job_id: str) -> bool: ...

    def resume(self, job_id: str) -> bool: ...

    def get(self, job_id: str) -> RunningJob | None:
        """The job's current object (a moved job gets a new one); None while it waits, or when unknown."""

    def held_back(self, job_id: str) -> str | None:
        """Why the job got no work lately (None: it did, or unknown)."""

    def plan_step(self, job_id: str) -> int:
        """Step id of the last plan of the job's engine (-1: none, or the job runs on no engine)."""

    def pop_events(self) -> list[JobEvent]: ...

    def pop_notices(self) -> list[JobNotice]: ...

