"""Fine-tuning jobs run offline next to `LLM` (their spec: `coserve.jobs.prepared_job`).

    from coserve import LLM
    llm = LLM(model="path/to/hf-folder", dtype="float32")
    result = llm.fine_tune(examples, output_dir="out/my-job", hyperparameters={"n_epochs": 2})
    # result.adapter_path is a PEFT folder: serve it with LoRARequest("mine", 1, result.adapter_path)

`LLM.start_fine_tune` returns at once; the job then trains inside every `generate`/`chat` call (the
same iterations as the inference tokens) and `LLM.wait` finishes it. Offline there is no latency
SLO: each iteration gives fine-tuning what the inference tokens leave of `max_batch_tokens`
(forward-window tokens, or the same number of full-depth tokens as backward token-layers).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

from coserve.contract.job_spec import FinetuneJobSpec, JobEvent, JobEventKind, JobState
from coserve.contract.plan import IterationPlan, IterationResult
from coserve.finetune.host import JobHost
from coserve.finetune.job import CoservedJob
from coserve.finetune.roster import whole_iteration_allowance
from coserve.inference.adapter_slots import AdapterSlots
from coserve.inference.kv_blocks import KVBlockManager
from coserve.jobs.prepared_job import FIRST_TRAINING_ADAPTER_ID
from coserve.tenancy.vtc import VirtualTokenCounter, VTCWeights


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
    job: CoservedJob
    warnings: list[str]
    events: list[JobEvent] = field(default_factory=list)


class OfflineJobs:
    """Fine-tuning jobs attached to one policy and engine: the `LLM`'s `EngineCore` `JobSide` (the
    core calls `schedule` after the policy plans an iteration and `update` after the engine ran it).

    The jobs live in a `JobHost` (`host`), the same class the co-serving policy keeps its jobs in, so
    the server's `JobManager` can drive offline jobs through it too (add, cancel, pause, resume, pop
    events); offline there is no SLO, so the allowance is what the inference tokens leave of
    `max_batch_tokens`. Jobs submitted here stay here, finished, for their results.
    """

    def __init__(self, kv: KVBlockManager, adapters: AdapterSlots, max_batch_tokens: int,
                 num_layers: int) -> None:
        self.host = JobHost(VirtualTokenCounter(VTCWeights()), kv, adapters)
        self._max_batch_tokens, self._num_layers = max_batch_tokens, num_layers
        self._jobs: dict[str, _Tracked] = {}
        self._adapter_ids = itertools.count(FIRST_TRAINING_ADAPTER_ID)

    def next_adapter_id(self) -> int:
        return next(self._adapter_ids)

    def submit(self, spec: FinetuneJobSpec, warnings: Sequence[str] = ()) -> CoservedJob:
        """Schedule a job from the next iteration on (`warnings`: what preparing its data found).
        Raises ValueError on a duplicate id."""
        if spec.job_id in self._jobs:
            raise ValueError(f"job id {spec.job_id!r} is already used")
        job = self.host.start(spec)
        self._jobs[job.job_id] = _Tracked(job, list(warnings))
        return job

    def add_events(self, events: Sequence[JobEvent]) -> None:
        """Keep events reported beside the jobs (a reinforcement job's evaluations)."""
        for event in events:
            tracked = self._jobs.get(event.job_id)
            if tracked is not None:
                tracked.events.append(event)

    def _collect_events(self) -> None:
        """Keep the events of the jobs submitted here (a `JobManager` pops its own from `host`)."""
        self.add_events(self.host.pop_events())

    def schedule(self, plan: IterationPlan) -> None:
        """Apply deferred control, then give the running jobs what the inference tokens leave of
        the iteration's token budget."""
        roster = self.host.roster
        roster.apply_control(plan)
        budget = max(0, self._max_batch_tokens - plan.num_tokens)
        if budget == 0:
            return
        # Both amounts: a sequence whose forward completes may start its backward at once.
        roster.fill(plan, whole_iteration_allowance(budget, budget * self._num_layers))

    def update(self, plan: IterationPlan, result: IterationResult) -> None:
        self.host.roster.update(plan, result)

    def result(self, job_id: str) -> FineTuneResult:
        self._collect_events()  # events nobody popped yet belong to the result too
        tracked = self._jobs[job_id]
        job, events = tracked.job, tracked.events
        final = next((e.path for e in events if e.kind == JobEventKind.SUCCEEDED), None)
        failure = next((e for e in events if e.kind == JobEventKind.FAILED), None)
        return FineTuneResult(
            job_id=job_id, state=job.state, adapter_path=final,
            checkpoints=[e.path for e in events if e.kind == JobEventKind.CHECKPOINT and e.path],
            events=list(events), trained_tokens=job.trained_tokens, warnings=list(tracked.warnings),
            error=None if failure is None else f"{failure.code}: {failure.message}")

    def job(self, job_id: str) -> CoservedJob:
        return self._jobs[job_id].job
