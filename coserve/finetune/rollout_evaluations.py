"""A reinforcement job's evaluations: its validation prompts sampled with the weights of a step and graded,
reported as a validation event (`valid_reward_mean`, ...). Pure Python.

An evaluation is due at step 0 (the base model's reward, the baseline), every `eval_interval` steps, and
after the last step; it starts only between steps (no batch in flight or fed), so its completions sample
the weights of exactly that step, and the rollout loop feeds the next batch only once they are sampled.
A job with validation prompts holds its final save until its last evaluation is graded (the adapter is
dropped from its slot with the save, and the evaluation's event comes before the job's end).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

from coserve.contract.job_spec import JobEvent, JobEventKind
from coserve.contract.reinforcement import GradedSample, RolloutGrading, RolloutSpec
from coserve.finetune.job import CoservedJob
from coserve.finetune.rollout_batches import FedBatches
from coserve.finetune.rollout_sampling import Sampling, StepOutputs, record

# (name, prompt index, prompt, samples, seed) -> the submitted completions (`RolloutDriver._sample`)
Sample = Callable[[str, int, list[int], int, int], list[Sampling]]


def reward_metrics(prefix: str, grades: Sequence[GradedSample]) -> dict[str, float]:
    """`{prefix}_reward_mean/max/min`, the share of samples that could not be graded, and each sub-grader's
    mean reward as `{prefix}_reward/<name>`."""
    rewards = [g.reward for g in grades]
    metrics = {f"{prefix}_reward_mean": sum(rewards) / len(rewards), f"{prefix}_reward_max": max(rewards),
               f"{prefix}_reward_min": min(rewards),
               f"{prefix}_grade_errors": sum(1 for g in grades if g.error is not None) / len(grades)}
    names = sorted({name for g in grades for name in g.sub_rewards})
    for name in names:
        values = [g.sub_rewards[name] for g in grades if name in g.sub_rewards]
        metrics[f"{prefix}_reward/{name}"] = sum(values) / len(values)
    return metrics


@dataclass(slots=True)
class _Evaluation:
    step: int
    final: bool
    samplings: list[Sampling]
    grading: Future[list[GradedSample]] | None = None

    @property
    def sampled(self) -> bool:
        return all(s.request.is_finished for s in self.samplings)


@dataclass(slots=True)
class Evaluations:
    """The evaluations of one job (module docstring)."""

    job: CoservedJob
    fed: FedBatches  # the job's source: its final save waits for the final evaluation's sampling
    spec: RolloutSpec
    sample: Sample
    grading: RolloutGrading
    _sampling: _Evaluation | None = None
    _graded: list[_Evaluation] = field(default_factory=list)
    _started: set[int] = field(default_factory=set)
    _events: list[JobEvent] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.spec.eval_prompts:
            self.fed.hold_finish = True  # until the final weights are sampled

    @property
    def sampling(self) -> bool:
        """Whether an evaluation's completions are in flight (the weights must not change)."""
        return self._sampling is not None

    def record(self, outputs: StepOutputs) -> int:
        return record(self._sampling.samplings, outputs) if self._sampling is not None else 0

    def advance(self) -> None:
        """Grade a sampled evaluation; report a graded one."""
        current = self._sampling
        if current is not None and current.sampled:
            rows = [self.spec.eval_items[s.prompt_index] for s in current.samplings]
            current.grading = self.grading.grade(self.job.tenant, self.spec.grader, rows,
                                                 [s.completion() for s in current.samplings])
            self._graded.append(current)
            self._sampling = None
        for evaluation in [e for e in self._graded if e.grading is not None and e.grading.done()]:
            self._graded.remove(evaluation)
            assert evaluation.grading is not None
            self._events.append(JobEvent(self.job.job_id, JobEventKind.VALIDATION, evaluation.step,
                                         metrics=reward_metrics("valid", evaluation.grading.result()),
                                         message=f"validation reward after step {evaluation.step}"))
            if evaluation.final:
                self.fed.hold_finish = False

    def start_due(self) -> None:
        """Start the evaluation of the current step's weights if one is due (module docstring)."""
        job, spec = self.job, self.spec
        if not spec.eval_prompts or self._sampling is not None or not job.between_batches or self.fed.queued:
            return
        step, final = job.position.step, job.position.epoch >= job.spec.n_epochs
        if step in self._started or not (final or step % spec.eval_interval == 0):
            return
        self._started.add(step)
        samplings = []
        for index, prompt in enumerate(spec.eval_prompts):
            seed = job.spec.seed * 1_000_033 + step * 10_009 + index
            samplings += self.sample(f"e{step}.{index}", index, prompt, spec.eval_samples, seed)
        self._sampling = _Evaluation(step, final, samplings)

    def drop(self) -> list[Sampling]:
        """The job ended: the completions in flight (to abort); nothing more is reported."""
        in_flight = self._sampling.samplings if self._sampling is not None else []
        self._sampling = None
        self._graded.clear()
        return in_flight

    def pop_events(self) -> list[JobEvent]:
        events, self._events = self._events, []
        return events
