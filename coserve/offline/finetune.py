"""Fine-tuning jobs run offline next to `LLM` (their spec: `coserve.jobs.prepared_job`).

    from coserve import LLM
    llm = LLM(model="path/to/hf-folder", dtype="float32")
    result = llm.fine_tune(examples, output_dir="out/my-job", hyperparameters={"n_epochs": 2})
    # result.adapter_path is a PEFT folder: serve it with LoRARequest("mine", 1, result.adapter_path)

`LLM.start_fine_tune` returns at once; the job then trains inside every `generate`/`chat` call (the
same iterations as the inference tokens) and `LLM.wait` finishes it. The `LLM` is a cluster of one engine
(`coserve.cluster.engine_cluster.EngineCluster`, as the server's), so its jobs are the cluster's
(`ClusterJobs`: placed, planned and ended as on a server); offline there is no latency SLO: its planner's
share gives fine-tuning what the inference tokens leave of each iteration (`planner.fill.FillShare`).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

from coserve.cluster.jobs import ClusterJobs
from coserve.contract.job_spec import FinetuneJobSpec, JobEvent, JobEventKind, JobState
from coserve.finetune.job import CoservedJob
from coserve.jobs.prepared_job import FIRST_TRAINING_ADAPTER_ID


@dataclass(slots=True)
class FineTuneResult:
    """A finished offline job."""

    job_id: str
    state: JobState
    adapter_path: str | None  # the final PEFT adapter (None unless the job succeeded)
    checkpoints: list[str]  # one resumable, servable checkpoint per epoch
    events: list[JobEvent]
    trained_tokens: int
    warnings: list[str] = field(default_factory=list)
    error: str | None = None

    @property
    def losses(self) -> list[float]:
        """The mean training loss of every optimizer step, in order."""
        return [e.loss for e in self.events if e.kind == JobEventKind.STEP and e.loss is not None]

    @property
    def validation_losses(self) -> list[float]:
        """The validation set's mean token loss at the end of each epoch (empty without one)."""
        return [e.loss for e in self.events if e.kind == JobEventKind.VALIDATION and e.loss is not None]


@dataclass(slots=True)
class _Tracked:
    job: CoservedJob | None  # its last placement's state (None: never placed)
    warnings: list[str]
    events: list[JobEvent] = field(default_factory=list)


class OfflineJobs:
    """The fine-tuning jobs an `LLM` submitted and their results, over the cluster's jobs (`runner`, the
    `ClusterJobs` a server's `JobManager` drives too). Jobs submitted here are remembered, finished, for
    their results; their events are collected when a result is asked for (a `JobManager` driving the same
    runner pops its own jobs' events).
    """

    def __init__(self, runner: ClusterJobs) -> None:
        self.runner = runner
        self._jobs: dict[str, _Tracked] = {}
        self._adapter_ids = itertools.count(FIRST_TRAINING_ADAPTER_ID)

    def next_adapter_id(self) -> int:
        return next(self._adapter_ids)

    def submit(self, spec: FinetuneJobSpec, warnings: Sequence[str] = ()) -> str:
        """Schedule a job from the next iteration on (`warnings`: what preparing its data found).
        Raises ValueError on a duplicate id."""
        if spec.job_id in self._jobs:
            raise ValueError(f"job id {spec.job_id!r} is already used")
        self.runner.start(spec)
        self._jobs[spec.job_id] = _Tracked(self.runner.get(spec.job_id), list(warnings))
        return spec.job_id

    def ended(self, job_id: str) -> bool:
        """Whether the job has ended (it is no longer the runner's)."""
        self._latest(job_id)
        return job_id not in self.runner.job_ids

    def give_up(self, job_id: str) -> None:
        """The job waits for a placement that nothing will give (its one engine is idle: a sequence longer
        than the KV memory jobs may use, say): it is taken back, and fails saying why."""
        reason = self.runner.waiting_reason(job_id)
        self.runner.cancel(job_id)
        self._collect_events()
        tracked = self._jobs[job_id]
        tracked.events = [e for e in tracked.events if e.kind is not JobEventKind.CANCELLED]
        tracked.events.append(JobEvent(job_id, JobEventKind.FAILED, 0, code="job_unplaceable",
                                       message=f"the job cannot start: {reason}"))

    def _latest(self, job_id: str) -> None:
        job = self.runner.get(job_id)
        if job is not None:
            self._jobs[job_id].job = job  # placed (or moved) since

    def _collect_events(self) -> None:
        for event in self.runner.pop_events():
            tracked = self._jobs.get(event.job_id)
            if tracked is not None:
                tracked.events.append(event)

    def result(self, job_id: str) -> FineTuneResult:
        self._collect_events()  # events nobody popped yet belong to the result too
        tracked = self._jobs[job_id]
        events, job = tracked.events, tracked.job
        final = next((e.path for e in events if e.kind == JobEventKind.SUCCEEDED), None)
        failure = next((e for e in events if e.kind == JobEventKind.FAILED), None)
        end = next((e for e in events if e.kind in (JobEventKind.SUCCEEDED, JobEventKind.FAILED,
                                                     JobEventKind.CANCELLED)), None)
        state = JobState(end.kind.value) if end is not None else JobState.RUNNING if job is None else job.state
        return FineTuneResult(
            job_id=job_id, state=state, adapter_path=final,
            checkpoints=[e.path for e in events if e.kind == JobEventKind.CHECKPOINT and e.path],
            events=list(events), trained_tokens=0 if job is None else job.trained_tokens,
            warnings=list(tracked.warnings), error=None if failure is None else f"{failure.code}: {failure.message}")

    def job(self, job_id: str) -> CoservedJob | None:
        """The job's scheduler state (None while it waits to be placed)."""
        self._latest(job_id)
        return self._jobs[job_id].job
