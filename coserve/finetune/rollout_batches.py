"""A reinforcement job's batches: graded rollouts, fed to the job as they are ready. Pure Python.

A rollout is a prompt and the completion the job's own adapter sampled for it, with the log-prob the
sampler gave each completion token. Its group is the prompt's `samples` rollouts; GRPO's advantage of a
rollout is its reward's distance from its group's mean reward, in units of the group's standard deviation
(`group_advantages`; a group whose rewards are all equal carries no signal: its advantages are 0). Every
completion token of a rollout gets its rollout's advantage, and the loss (`importance_sampling`, `ppo` or
`cispo`) compares the trainer's log-prob of each token with the sampler's. A batch trains the mean over
its completion tokens (its `normalizer`). `FedBatches` is a reinforcement job's `BatchSource`: the graded
batches its rollout loop (`rollouts.RolloutDriver`) feeds it, in order.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from coserve.contract.data_position import DataPosition
from coserve.contract.job_spec import FinetuneJobSpec
from coserve.contract.loss_spec import TokenInputs
from coserve.contract.plan import IterationPlan
from coserve.contract.training_plan import TrainingExample
from coserve.finetune.batch_source import BatchSource, NoBatch, SourceJob
from coserve.finetune.progress import BatchProgress, SequenceProgress

ADVANTAGE_EPS = 1e-6


@dataclass(frozen=True, slots=True)
class Rollout:
    """One sampled completion of prompt `prompt_index`, its sampling log-probs and its reward."""

    prompt_index: int
    prompt_token_ids: list[int]
    completion_token_ids: list[int]
    sampling_logprobs: list[float]  # one per completion token
    reward: float

    def __post_init__(self) -> None:
        if len(self.sampling_logprobs) != len(self.completion_token_ids):
            raise ValueError("one sampling log-prob per completion token")


@dataclass(slots=True)
class FedBatch:
    """A batch of graded rollouts with their advantages, and where the job's data position goes after
    its step."""

    after: DataPosition
    rollouts: list[Rollout]
    advantages: list[float]  # one per rollout (`group_advantages` over each prompt's group)
    metrics: dict[str, float] = field(default_factory=dict)  # joined to the step's event (rewards)

    def __post_init__(self) -> None:
        if not any(r.completion_token_ids for r in self.rollouts) or len(self.advantages) != len(self.rollouts):
            raise ValueError("a fed batch needs a rollout with a completion token, and one advantage per "
                             "rollout")


def group_advantages(rewards: Sequence[float]) -> list[float]:
    """GRPO's group-relative advantages: (r - mean) / std (population std); 0 for a constant group."""
    mean = sum(rewards) / len(rewards)
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards))
    if std < ADVANTAGE_EPS:
        return [0.0] * len(rewards)
    return [(r - mean) / std for r in rewards]


def _sequence(rollout: Rollout, advantage: float) -> tuple[TrainingExample, TokenInputs]:
    """The rollout as a training sequence: prompt then completion, the completion trained; the token
    arrays aligned with the token ids (entry t: token t)."""
    prompt, completion = len(rollout.prompt_token_ids), len(rollout.completion_token_ids)
    example = TrainingExample(rollout.prompt_token_ids + rollout.completion_token_ids,
                              [False] * prompt + [True] * completion)
    inputs = TokenInputs(sampling_logprobs=[0.0] * prompt + list(rollout.sampling_logprobs),
                         advantages=[0.0] * prompt + [advantage] * completion)
    return example, inputs


def fed_batch_progress(fed: FedBatch, num_layers: int, prefix: str) -> BatchProgress:
    """The batch's training sequences (rollouts without a completion token train nothing: left out)."""
    sequences = []
    for k, (rollout, advantage) in enumerate(zip(fed.rollouts, fed.advantages, strict=True)):
        if not rollout.completion_token_ids:
            continue
        example, inputs = _sequence(rollout, advantage)
        seq = SequenceProgress(f"{prefix}.{k}", rollout.prompt_index, len(example.token_ids), num_layers,
                               group=k, example=example, inputs=inputs)
        seq.reset()
        sequences.append(seq)
    normalizer = sum(len(r.completion_token_ids) for r in fed.rollouts)
    return BatchProgress(after=fed.after, normalizer=max(1, normalizer), sequences=sequences,
                         metrics=dict(fed.metrics))


class FedBatches(BatchSource):
    """A reinforcement job's graded batches, queued until the job takes them (module docstring)."""

    def __init__(self, spec: FinetuneJobSpec) -> None:
        self.spec = spec
        self._queue: list[FedBatch] = []
        self.hold_finish = False  # its final evaluation is still sampling its last weights: no final save yet

    def feed(self, batch: FedBatch) -> None:
        self._queue.append(batch)

    @property
    def queued(self) -> bool:
        """Whether a graded batch waits for the job."""
        return bool(self._queue)

    def next_batch(self, job: SourceJob, plan: IterationPlan) -> BatchProgress | NoBatch:
        if job.position.epoch >= self.spec.n_epochs:
            return NoBatch.WAIT if self.hold_finish else NoBatch.DONE
        if not self._queue:
            return NoBatch.WAIT  # its rollout loop is sampling or grading it
        fed = self._queue.pop(0)
        return fed_batch_progress(fed, self.spec.num_layers, f"{self.spec.job_id}/s{fed.after.step}")

    def batch_planned(self, batch: BatchProgress, plan: IterationPlan) -> bool:
        return True


def fed_batches(source: BatchSource) -> FedBatches:
    """A reinforcement job's source.

    Raises:
        ValueError: the job is not a reinforcement job.
    """
    if not isinstance(source, FedBatches):
        raise ValueError("not a reinforcement job: its batches are not fed")
    return source
