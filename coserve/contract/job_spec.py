"""What a fine-tuning job is, for the scheduler: its spec (tokenized examples, hyperparameters), its
states and phases, and the events it reports. Pure Python: no torch, no Ray."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from coserve.contract import defaults
from coserve.contract.data_position import DataPosition
from coserve.contract.loss_spec import LossKind, LossSpec
from coserve.contract.reinforcement import RolloutSpec
from coserve.contract.training_plan import TrainingExample
from coserve.contract.training_settings import LoRASettings, OptimizerSettings

# A job's smallest backward tasklet, except for a layer's last tokens (`FinetuneJobSpec`).
MIN_TASKLET_TOKENS = 16


class JobPhase(enum.Enum):
    FORWARD = "forward"
    BACKWARD = "backward"


class JobState(enum.Enum):
    RUNNING = "running"
    PAUSED = "paused"
    FINISHING = "finishing"  # the final save is planned; waiting for its result
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def is_finished(self) -> bool:
        return self in (JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED)


class JobEventKind(enum.Enum):
    STEP = "step"
    CHECKPOINT = "checkpoint"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    VALIDATION = "validation"  # `loss` is the validation set's mean token loss after step `step`


@dataclass(slots=True)
class JobEvent:
    """Something a job did, for the job's event log and metrics."""

    job_id: str
    kind: JobEventKind
    step: int
    loss: float | None = None
    grad_norm: float | None = None
    learning_rate: float | None = None
    num_tokens: int = 0
    path: str | None = None
    epoch: int | None = None
    code: str | None = None
    message: str = ""
    metrics: dict[str, float] = field(default_factory=dict)  # a DPO step's rewards (TRL's names)


@dataclass(frozen=True, slots=True)
class FinetuneJobSpec:
    """What a job trains and how. Examples are tokenized, with at least one trained token each.

    A DPO job (`loss.kind` dpo) trains on pairs: `examples[i]` is pair i's chosen answer and
    `rejected_examples[i]` its rejected one. `reference_logprobs` holds the pairs' reference sums known
    when the job starts (pair index -> (chosen, rejected), from the checkpoint a resume starts from).
    A reinforcement job (a policy-gradient loss) has prompts for examples (nothing trained in them): its
    batches are its graded rollouts of them, fed to the job as they are ready (`CoservedJob.feed`), by
    the rollout loop that `rollouts` describes (`coserve.finetune.rollouts`; None: fed by the caller).
    """

    job_id: str
    tenant: str
    adapter_id: int  # unique among adapters: the bank slot's owner and the prefix-cache salt
    examples: list[TrainingExample]
    n_epochs: int
    batch_size: int
    seed: int
    num_layers: int
    output_dir: str  # checkpoints go to {output_dir}/ckpt-step-{N}, the final adapter to /final
    lora: LoRASettings = field(default_factory=LoRASettings)
    optimizer: OptimizerSettings = field(default_factory=OptimizerSettings)
    max_window_tokens: int = defaults.FINETUNE_WINDOW_TOKENS  # longest forward window (the budget may cut it)
    min_tasklet_tokens: int = MIN_TASKLET_TOKENS  # smaller backward tasklets only for a layer's last tokens
    resume_from: str | None = None  # checkpoint folder to resume from, with `start_position`
    init_adapter: str | None = None  # PEFT folder to start from instead of PEFT's init
    start_position: DataPosition | None = None
    start_trained_tokens: int = 0  # trained tokens of the steps before `start_position` (a resume's count)
    base_model_name_or_path: str | None = None
    validation_examples: list[TrainingExample] = field(default_factory=list)  # evaluated each epoch
    loss: LossSpec = field(default_factory=LossSpec)
    rejected_examples: list[TrainingExample] = field(default_factory=list)
    validation_rejected: list[TrainingExample] = field(default_factory=list)
    reference_logprobs: dict[int, tuple[float, float]] = field(default_factory=dict)
    rollouts: RolloutSpec | None = None
    driven: bool = False  # a run its client drives call by call (`contract.training_calls`): no examples

    @property
    def is_preference(self) -> bool:
        return self.loss.kind == LossKind.DPO

    @property
    def is_reinforcement(self) -> bool:
        return self.loss.kind.needs_sampling_logprobs

    def __post_init__(self) -> None:
        checks = {"n_epochs": self.n_epochs, "batch_size": self.batch_size,
                  "num_layers": self.num_layers, "max_window_tokens": self.max_window_tokens,
                  "min_tasklet_tokens": self.min_tasklet_tokens}
        for name, value in checks.items():
            if value < 1:
                raise ValueError(f"FinetuneJobSpec.{name} must be >= 1, got {value}")
        if not self.examples and not self.driven:
            raise ValueError(f"job {self.job_id}: no training examples")
        for i, example in enumerate(self.examples):
            if len(example.token_ids) < 2 or len(example.trained) != len(example.token_ids):
                raise ValueError(f"job {self.job_id}: example {i} needs >= 2 tokens and one "
                                 f"trained flag per token")
            if not any(example.trained[1:]) and not self.is_reinforcement:
                raise ValueError(f"job {self.job_id}: example {i} has no trained token")
        if self.is_preference != bool(self.rejected_examples) or (
                self.is_preference and len(self.rejected_examples) != len(self.examples)):
            raise ValueError(f"job {self.job_id}: a DPO job has one rejected example per example, and "
                             f"only a DPO job has rejected examples")
        if len(self.validation_rejected) != (len(self.validation_examples) if self.is_preference else 0):
            raise ValueError(f"job {self.job_id}: a DPO job has one rejected validation example per "
                             f"validation example")
        for i, example in enumerate(self.rejected_examples):
            if len(example.token_ids) < 2 or not any(example.trained[1:]):
                raise ValueError(f"job {self.job_id}: rejected example {i} has no trained token")
        if self.is_reinforcement and (self.validation_examples or any(any(e.trained) for e in self.examples)):
            raise ValueError(f"job {self.job_id}: a reinforcement job's examples are prompts (nothing "
                             f"trained), and it has no validation examples")
        if self.rollouts is not None and (not self.is_reinforcement
                                          or len(self.rollouts.items) != len(self.examples)):
            raise ValueError(f"job {self.job_id}: a rollout loop belongs to a reinforcement job, with one "
                             f"row per prompt")
        if (self.resume_from is None) != (self.start_position is None):
            raise ValueError("resume_from and start_position go together")
        if self.start_trained_tokens < 0 or (self.start_trained_tokens and self.start_position is None):
            raise ValueError(f"start_trained_tokens {self.start_trained_tokens}: must be >= 0, and 0 "
                             f"without a start position")


def trained_tokens(example: TrainingExample) -> int:
    """Positions with a target: token p is the target of p - 1, so token 0 never counts."""
    return sum(example.trained[1:])


def unit_tokens(spec: FinetuneJobSpec, index: int) -> int:
    """Trained tokens of the job's example `index`: its sequence's, or both sides of a DPO pair."""
    tokens = trained_tokens(spec.examples[index])
    return tokens + trained_tokens(spec.rejected_examples[index]) if spec.is_preference else tokens


def trained_tokens_before(spec: FinetuneJobSpec, position: DataPosition) -> int:
    """Trained tokens of the steps a job did before `position` (each epoch visits every example once,
    in `position.order`): the count to resume from when a checkpoint predates keeping it."""
    count = len(spec.examples)
    per_epoch = sum(unit_tokens(spec, i) for i in range(count))
    done = position.order(count)[:position.index]
    return position.epoch * per_epoch + sum(unit_tokens(spec, i) for i in done)
