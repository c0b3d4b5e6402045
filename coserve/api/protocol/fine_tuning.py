"""`/v1/fine_tuning/jobs`: the create request, jobs, events, checkpoints and their list pages.

Fields follow https://platform.openai.com/docs/api-reference/fine-tuning and the bounds of OpenAI's
spec (n_epochs 1..50, batch_size 1..256, learning_rate_multiplier > 0; coserve caps it at 10; DPO's beta
in (0, 10]). The methods `supervised`, `dpo` and `reinforcement` (OpenAI's shape: a `grader` and
hyperparameters; coserve's extension `max_completion_tokens`, the longest rollout) are implemented. The
coserve extension `lora` takes PEFT's names. The shape only: the gateway turns a body into the one typed
`JobRequest` (`coserve.contract.job_request`), which checks the values (a reinforcement job's grader and
its hyperparameters beyond the supervised ones: `coserve.contract.reinforcement.ReinforcementRequest`).
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, model_validator

from coserve.api.protocol.base import OpenAIBaseModel, now, param_error
from coserve.api.protocol.graders import check_grader_keys
from coserve.api.protocol.param_support import FINE_TUNING_JOBS, EndpointParams
from coserve.api.protocol.strict import RequestBody, RequestModel
from coserve.contract.job_request import MAX_WORKERS
from coserve.contract.loss_spec import MAX_BETA
from coserve.contract.training_settings import BOUNDS, MAX_LEARNING_RATE_MULTIPLIER

JobStatus = Literal["validating_files", "queued", "running", "succeeded", "failed", "cancelled",
                    "paused"]  # "paused" is not in the SDK's Literal; its lenient parser accepts it
TERMINAL_STATUSES: frozenset[str] = frozenset({"succeeded", "failed", "cancelled"})

Auto = Literal["auto"]
NEpochs = Auto | Annotated[int, Field(ge=BOUNDS["n_epochs"][0], le=BOUNDS["n_epochs"][1])]
BatchSize = Auto | Annotated[int, Field(ge=BOUNDS["batch_size"][0], le=BOUNDS["batch_size"][1])]
LearningRateMultiplier = Auto | Annotated[float, Field(gt=0.0, le=MAX_LEARNING_RATE_MULTIPLIER)]


class Hyperparameters(RequestModel):
    """Training hyperparameters; "auto" lets coserve choose (resolved values are echoed in the job).
    An unknown name is a 400 (a typo such as `n_epoch`, or DPO's `beta` on a supervised job), as is an
    unknown key anywhere in a request (`strict.RequestModel`)."""

    batch_size: BatchSize | None = "auto"
    learning_rate_multiplier: LearningRateMultiplier | None = "auto"
    n_epochs: NEpochs | None = "auto"


class DpoHyperparameters(Hyperparameters):
    """DPO's hyperparameters: the supervised ones and `beta`, the strength of the pull towards the
    reference (the base model); "auto" is 0.1."""

    beta: Auto | Annotated[float, Field(gt=0.0, le=MAX_BETA, allow_inf_nan=False)] | None = "auto"


class ReinforcementHyperparameters(Hyperparameters):
    """Reinforcement's hyperparameters (OpenAI's names): the supervised ones, `compute_multiplier`,
    `eval_interval`, `eval_samples` ("auto" for each) and `reasoning_effort` ("default" when unset). The
    values are checked by `ReinforcementRequest`, which says what they mean on coserve."""

    compute_multiplier: Auto | float | None = "auto"
    eval_interval: Auto | int | None = "auto"
    eval_samples: Auto | int | None = "auto"
    reasoning_effort: Literal["default", "low", "medium", "high"] | None = "default"


class SupervisedMethod(RequestModel):
    """Configuration of supervised fine-tuning."""

    hyperparameters: Hyperparameters | None = None


class DpoMethod(RequestModel):
    """Configuration of DPO fine-tuning."""

    hyperparameters: DpoHyperparameters | None = None


class ReinforcementMethod(RequestModel):
    """Configuration of reinforcement fine-tuning: the `grader` (OpenAI's grader JSON, parsed and checked
    by the gateway: `coserve.contract.grader`), its hyperparameters, and the coserve extension
    `max_completion_tokens` (the longest rollout; default 256)."""

    grader: dict[str, Any]
    hyperparameters: ReinforcementHyperparameters | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None  # coserve extension


METHODS = ("supervised", "dpo", "reinforcement")


class Method(RequestModel):
    """The fine-tuning method: `supervised`, `dpo` or `reinforcement`, with its settings under the key of
    that name (OpenAI's shape); a reinforcement job needs them (its grader)."""

    type: Literal["supervised", "dpo", "reinforcement"]
    supervised: SupervisedMethod | None = None
    dpo: DpoMethod | None = None
    reinforcement: ReinforcementMethod | None = None

    @model_validator(mode="after")
    def _settings_of_its_type(self) -> Method:
        if self.type == "reinforcement" and self.reinforcement is None:
            raise param_error("reinforcement", "a reinforcement job needs 'method.reinforcement' with its "
                              "'grader'")
        for other in METHODS:
            if other != self.type and getattr(self, other) is not None:
                raise param_error(other, f"'method.{other}' configures the {other} method, and this "
                                  f"job's method type is '{self.type}'")
        return self

    def given_hyperparameters(self) -> Hyperparameters | None:
        """The hyperparameters under the method's own key (None: not given)."""
        settings: SupervisedMethod | DpoMethod | ReinforcementMethod | None = getattr(self, self.type)
        return settings.hyperparameters if settings is not None else None


class LoRAParams(RequestModel):
    """coserve extension: the LoRA adapter to train, in PEFT's `LoraConfig` names. None = server default.

    The wire shape only: what the trainer accepts is `coserve.contract.training_settings.LoRASettings`,
    which the gateway builds from these (its `SettingsError` is the 400, naming `lora.<param>`).
    """

    r: Annotated[int, Field(ge=1, le=256)] | None = None
    # Finite: a JSON body may carry `Infinity` (Python's parser accepts it), which the store cannot keep.
    lora_alpha: Annotated[float, Field(gt=0.0, allow_inf_nan=False)] | None = None
    lora_dropout: Annotated[float, Field(ge=0.0, lt=1.0)] | None = None
    target_modules: Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1)] | None = None
    use_rslora: bool | None = None


class TrainingParams(RequestModel):
    """coserve extension: where the job trains. `mode` "coserved" (in the shared engines' iterations, the
    default) or "dedicated" (a Ray Train run of its own on `workers` workers, default the server's
    `--dedicated-workers`). The wire shape only: `coserve.contract.job_request.TrainingRequest` checks it."""

    mode: Literal["coserved", "dedicated"] | None = None
    workers: Annotated[int, Field(ge=1, le=MAX_WORKERS)] | None = None


MetadataKey = Annotated[str, Field(min_length=1, max_length=64)]
MetadataValue = Annotated[str, Field(max_length=512)]


class FineTuningJobCreate(RequestBody):
    """The body of `POST /v1/fine_tuning/jobs`.

    `suffix` is restricted to `[A-Za-z0-9_-]{1,64}` because it becomes part of a model id
    (`ft:{base}:{tenant}:{suffix}:{id}`), where `:` or `/` would break parsing and paths.
    `hyperparameters` (deprecated by OpenAI) and the method's own (`method.<type>.hyperparameters`) may not
    both be set.
    """

    model: Annotated[str, Field(min_length=1)]
    training_file: Annotated[str, Field(min_length=1)]
    hyperparameters: Hyperparameters | None = None
    method: Method | None = None
    suffix: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")] | None = None
    validation_file: str | None = None
    seed: Annotated[int, Field(ge=0, le=2147483647)] | None = None
    metadata: Annotated[dict[MetadataKey, MetadataValue], Field(max_length=16)] | None = None

    PARAMS: ClassVar[EndpointParams | None] = FINE_TUNING_JOBS  # refused: `integrations`

    # --- coserve extensions (not in the OpenAI spec; send them with `extra_body=`) ---
    lora: LoRAParams | None = None
    training: TrainingParams | None = None
    # --- end of coserve extensions ---

    @model_validator(mode="after")
    def _one_hyperparameter_source(self) -> FineTuningJobCreate:
        method_hp = self.method.given_hyperparameters() if self.method else None
        if self.hyperparameters is not None and method_hp is not None:
            key = self.method.type if self.method else "supervised"
            raise param_error("hyperparameters", f"set 'method.{key}.hyperparameters' or the "
                              f"deprecated 'hyperparameters', not both")
        return self

    @model_validator(mode="after")
    def _known_grader_keys(self) -> FineTuningJobCreate:
        settings = self.method.reinforcement if self.method is not None else None
        if settings is not None:
            check_grader_keys(settings.grader, "method.reinforcement.grader")
        return self

    def requested_hyperparameters(self) -> Hyperparameters:
        """The hyperparameters from whichever place the client used, their default ("auto"; reasoning's
        "default") where unset (DPO's `beta` and reinforcement's own included)."""
        hp = (self.method.given_hyperparameters() if self.method else None) or self.hyperparameters \
            or Hyperparameters()
        values = {name: default if (value := getattr(hp, name)) is None else value
                  for name, default in _defaults(type(hp)).items()}
        return type(hp).model_validate(values)


def _defaults(model: type[Hyperparameters]) -> dict[str, Any]:
    return {name: info.default for name, info in model.model_fields.items()}


class FineTuningJobError(OpenAIBaseModel):
    """Why a job failed, e.g. code `invalid_n_examples` with param `training_file`."""

    code: str
    message: str
    param: str | None = None


class FineTuningJob(OpenAIBaseModel):
    """The `fine_tuning.job` object. `error` is null unless the job failed."""

    id: str
    object: Literal["fine_tuning.job"] = "fine_tuning.job"
    created_at: int = Field(default_factory=now)
    error: FineTuningJobError | None = None
    fine_tuned_model: str | None = None
    finished_at: int | None = None
    hyperparameters: Hyperparameters
    model: str
    organization_id: str
    result_files: list[str] = Field(default_factory=list)
    seed: int
    status: JobStatus
    trained_tokens: int | None = None
    training_file: str
    validation_file: str | None = None
    estimated_finish: int | None = None
    integrations: list[dict[str, Any]] | None = None
    metadata: dict[str, str] | None = None
    method: Method | None = None
    user_provided_suffix: str | None = None  # sent by OpenAI, absent from the SDK model

    # --- coserve extensions ---
    lora: LoRAParams | None = None
    training: TrainingParams | None = None  # where the job trains (a routed job says "dedicated" once routed)
    # --- end of coserve extensions ---


class FineTuningJobList(OpenAIBaseModel):
    """A page of jobs, newest first."""

    object: Literal["list"] = "list"
    data: list[FineTuningJob]
    has_more: bool = False


class MetricsData(OpenAIBaseModel):
    """The `data` of a metrics event: losses are per token, averaged over the step."""

    step: int
    train_loss: float | None = None
    valid_loss: float | None = None
    total_steps: int | None = None


class FineTuningJobEvent(OpenAIBaseModel):
    """A `fine_tuning.job.event`: a `message` event (`data` null) or a `metrics` event."""

    id: str
    object: Literal["fine_tuning.job.event"] = "fine_tuning.job.event"
    created_at: int = Field(default_factory=now)
    level: Literal["info", "warn", "error"] = "info"
    message: str
    data: dict[str, Any] | None = None
    type: Literal["message", "metrics"] | None = "message"

    @classmethod
    def metrics_event(cls, id: str, metrics: MetricsData,
                      created_at: int | None = None) -> FineTuningJobEvent:
        """A metrics event whose message reads like OpenAI's `Step 3/300: training loss=0.22, ...`."""
        parts = []
        if metrics.train_loss is not None:
            parts.append(f"training loss={metrics.train_loss:.4g}")
        if metrics.valid_loss is not None:
            parts.append(f"validation loss={metrics.valid_loss:.4g}")
        total = f"/{metrics.total_steps}" if metrics.total_steps is not None else ""
        return cls(id=id, created_at=created_at if created_at is not None else now(), type="metrics",
                   message=f"Step {metrics.step}{total}: " + ", ".join(parts),
                   data=metrics.model_dump(exclude_none=True))


class FineTuningJobEventList(OpenAIBaseModel):
    """A page of a job's events, newest first."""

    object: Literal["list"] = "list"
    data: list[FineTuningJobEvent]
    has_more: bool = False


class CheckpointMetrics(OpenAIBaseModel):
    """Metrics at a checkpoint's step (all optional, as in OpenAI's object)."""

    step: float | None = None
    train_loss: float | None = None
    train_mean_token_accuracy: float | None = None
    valid_loss: float | None = None
    valid_mean_token_accuracy: float | None = None
    full_valid_loss: float | None = None
    full_valid_mean_token_accuracy: float | None = None


class FineTuningJobCheckpoint(OpenAIBaseModel):
    """A `fine_tuning.job.checkpoint`; `fine_tuned_model_checkpoint` is servable (`...:ckpt-step-N`)."""

    id: str
    object: Literal["fine_tuning.job.checkpoint"] = "fine_tuning.job.checkpoint"
    created_at: int = Field(default_factory=now)
    fine_tuned_model_checkpoint: str
    fine_tuning_job_id: str
    step_number: int
    metrics: CheckpointMetrics = Field(default_factory=CheckpointMetrics)


class FineTuningJobCheckpointList(OpenAIBaseModel):
    """A page of a job's checkpoints, highest step first."""

    object: Literal["list"] = "list"
    data: list[FineTuningJobCheckpoint]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool = False
