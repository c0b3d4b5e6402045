"""What a fine-tuning job is, for the scheduler: its spec (tokenized examples, hyperparameters), its
states and phases, and the events it reports. Pure Python: no torch, no Ray."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from coserve.contract.data_position import DataPosition
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


@dataclass(frozen=True, slots=True)
class FinetuneJobSpec:
    """What a job trains and how. Examples are tokenized, with at least one trained token each."""

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
    max_window_tokens: int = 256  # longest forward window (the policy's budget may cut it shorter)
    min_tasklet_tokens: int = MIN_TASKLET_TOKENS  # smaller backward tasklets only for a layer's last tokens
    resume_from: str | None = None  # checkpoint folder to resume from, with `start_position`
    init_adapter: str | None = None  # PEFT folder to start from instead of PEFT's init
    start_position: DataPosition | None = None
    start_trained_tokens: int = 0  # trained tokens of the steps before `start_position` (a resume's count)
    base_model_name_or_path: str | None = None
    validation_examples: list[TrainingExample] = field(default_factory=list)  # evaluated each epoch

    def __post_init__(self) -> None:
        checks = {"n_epochs": self.n_epochs, "batch_size": self.batch_size,
                  "num_layers": self.num_layers, "max_window_tokens": self.max_window_tokens,
                  "min_tasklet_tokens": self.min_tasklet_tokens}
        for name, value in checks.items():
            if value < 1:
                raise ValueError(f"FinetuneJobSpec.{name} must be >= 1, got {value}")
        if not self.examples:
            raise ValueError(f"job {self.job_id}: no training examples")
        for i, example in enumerate(self.examples):
            if len(example.token_ids) < 2 or len(example.trained) != len(example.token_ids):
                raise ValueError(f"job {self.job_id}: example {i} needs >= 2 tokens and one "
                                 f"trained flag per token")
            if not any(example.trained[1:]):
                raise ValueError(f"job {self.job_id}: example {i} has no trained token")
        if (self.resume_from is None) != (self.start_position is None):
            raise ValueError("resume_from and start_position go together")
        if self.start_trained_tokens < 0 or (self.start_trained_tokens and self.start_position is None):
            raise ValueError(f"start_trained_tokens {self.start_trained_tokens}: must be >= 0, and 0 "
                             f"without a start position")


def trained_tokens(example: TrainingExample) -> int:
    """Positions with a target: token p is the target of p - 1, so token 0 never counts."""
    return sum(example.trained[1:])


def trained_tokens_before(examples: list[TrainingExample], position: DataPosition) -> int:
    """Trained tokens of the steps a job did before `position` (each epoch visits every example once,
    in `position.order`): the count to resume from when a checkpoint predates keeping it."""
    per_epoch = sum(trained_tokens(e) for e in examples)
    done = position.order(len(examples))[:position.index]
    return position.epoch * per_epoch + sum(trained_tokens(examples[i]) for i in done)
