"""What crosses processes in a dedicated run: the run's spec (to the `DedicatedRun` actor and every Ray
Train worker), the command rank 0 gets back at each step boundary, and what the job manager polls.

Plain dataclasses and an int enum (no torch, no Ray), like the scheduler/engine contract.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from coserve.contract.job_spec import FinetuneJobSpec, JobEvent


class Command(enum.IntEnum):
    """What every worker does at the next step boundary (rank 0 asks, all ranks agree)."""

    RUN = 0
    PAUSE = 1  # hold here, workers kept, until RUN, RELEASE or STOP
    STOP = 2  # end the run now (the job was cancelled)
    RELEASE = 3  # paused too long: save a checkpoint here and end the run, its workers given back


@dataclass(frozen=True, slots=True)
class RunSpec:
    """One attempt at running a job on Ray Train.

    Args:
        job: the job (tokenized examples, hyperparameters, LoRA settings, where it resumes from), built
            by the same `prepare_job` as a co-served job's.
        model: the base model folder; dtype: its dtype on the workers (the engine's).
        storage_path, run_name: Ray Train's `RunConfig(storage_path, name)`: checkpoints land in
            `{storage_path}/{run_name}/ckpt-step-N`, the adapter in `.../final`.
        workers, use_gpu: `ScalingConfig(num_workers, use_gpu)`; max_failures: `FailureConfig`.
    """

    job: FinetuneJobSpec
    model: str
    dtype: str
    storage_path: str
    run_name: str
    workers: int
    use_gpu: bool = False
    max_failures: int = 3


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    rank: int
    host: str
    pid: int


@dataclass(slots=True)
class RunUpdate:
    """What a run reported since the last poll.

    `events` are the job's `JobEvent`s (steps, checkpoints, validation, success, failure, cancellation,
    in order); `notes` are messages for the job's event log (workers started, a worker failed and Ray
    Train restarts the group); `workers` the workers of the current attempt (empty until they start);
    `placement_group` the Ray placement group (hex id) holding the workers' resources; `done` the run
    has ended (its last event is among `events`); `released` it ended on `Command.RELEASE`, its checkpoint
    saved and no terminal event: the job goes on in a new run once it is resumed.
    """

    events: list[JobEvent] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    workers: list[WorkerInfo] = field(default_factory=list)
    placement_group: str | None = None
    done: bool = False
    released: bool = False
