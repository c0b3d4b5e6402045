"""The body of `POST /v1/fine_tuning/jobs` as the one typed `JobRequest` (`coserve.contract.job_request`),
or a 400 naming the param. The only place a job request is parsed: the row keeps what this returns.

What is refused here, before the job exists:
- a value the request's types refuse (`SettingsError`): 400 naming the param (`code` `invalid_lora`
  for a LoRA setting, `invalid_training` for the training extension, `invalid_grader` for a
  reinforcement job's grader);
- a reinforcement grader this server cannot run in a job (`grader_variables`): a `label_model` anywhere
  in it (no reinforcement grader in OpenAI's API either), a `score_model` whose judge is not a model the
  tenant may use, a `python` grader while python graders are off, a template or formula it cannot
  evaluate;
- `lora.r` above this server's `max_lora_rank`;
- a dedicated run (`training.mode` "dedicated") on a `--local` server: `dedicated_training_unavailable`;
  on Ray, more workers than the cluster can ever place at once: `insufficient_cluster_capacity`
  (param `training.workers`) naming the cluster's resources (it would otherwise wait forever).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from coserve.api.protocol.base import ProtocolError
from coserve.api.protocol.fine_tuning import FineTuningJobCreate, LoRAParams, TrainingParams
from coserve.contract.job_request import FineTuningMethod, JobRequest, TrainingMode, TrainingRequest
from coserve.contract.reinforcement import PARAM as REINFORCEMENT_PARAM
from coserve.contract.reinforcement import ReinforcementRequest
from coserve.contract.training_settings import HYPERPARAMETERS, HyperparameterRequest, LoRASettings, SettingsError
from coserve.graders.checks import Variable, check_grader
from coserve.graders.judging import model_graders

GRADER_PARAM = f"{REINFORCEMENT_PARAM}.grader"


class DedicatedCapacity(Protocol):
    """The cluster's room for dedicated workers (`coserve.dedicated.capacity.ClusterCapacity`)."""

    @property
    def default_workers(self) -> int: ...

    def refusal(self, workers: int) -> str | None:
        """Why `workers` workers can never run at once (None: they can)."""


def job_request(body: FineTuningJobCreate, max_lora_rank: int | None,
                dedicated: DedicatedCapacity | None) -> JobRequest:
    """The typed request of a create body (see the module docstring for what is refused).

    Raises:
        ProtocolError: 400 naming the param.
    """
    requested = body.requested_hyperparameters().model_dump()
    method = FineTuningMethod(body.method.type) if body.method else FineTuningMethod.SUPERVISED
    beta = requested.pop("beta", "auto")
    try:
        hyperparameters = HyperparameterRequest.from_dict({k: requested[k] for k in HYPERPARAMETERS})
        reinforcement = _reinforcement(body, requested) if method == FineTuningMethod.REINFORCEMENT else None
        return JobRequest(method=method, hyperparameters=hyperparameters,
                          beta=None if beta == "auto" else beta,
                          lora=_lora(body.lora, max_lora_rank),
                          training=_training(body.training, dedicated), reinforcement=reinforcement)
    except SettingsError as err:
        raise _settings_error(err) from None


def _settings_error(err: SettingsError) -> ProtocolError:
    """The 400 of a refused value; a grader's is `invalid_grader`."""
    code = "invalid_grader" if err.param.startswith(GRADER_PARAM) else None
    return ProtocolError(err.message, param=err.param, code=code)


def _reinforcement(body: FineTuningJobCreate, requested: dict[str, Any]) -> ReinforcementRequest:
    """`method.reinforcement` typed: its grader and the hyperparameters beyond the supervised ones (from
    `requested`, which holds "auto" (reasoning: "default") for what the client left unset).

    Raises:
        SettingsError: a bad grader or value, naming its param.
    """
    settings = body.method.reinforcement if body.method else None
    assert settings is not None  # `Method` requires it for the reinforcement type

    def given(name: str) -> Any:
        value = requested.get(name)
        return None if value in ("auto", "default", None) else value

    return ReinforcementRequest(grader=settings.grader, compute_multiplier=given("compute_multiplier"),
                                eval_interval=given("eval_interval"), eval_samples=given("eval_samples"),
                                reasoning_effort=given("reasoning_effort"),
                                max_completion_tokens=settings.max_completion_tokens)


def grader_variables(request: ReinforcementRequest, python: bool, judge_model: Callable[[str], bool]) -> list[Variable]:
    """The template variables a reinforcement job's grader reads, once this server can run it in a job.
    `python`: python graders are on (`--enable-python-graders`); `judge_model`: whether a model id is one
    the tenant may use (this server's base model or one of its fine-tuned models).

    Raises:
        ProtocolError: 400 `invalid_grader` naming the grader field it cannot run: a `label_model` (no
            reinforcement grader in OpenAI's API either), a `score_model` whose judge is not such a model,
            a python grader while they are off, a template or formula it cannot evaluate.
    """
    grader = request.parsed_grader()
    for judge, param in model_graders(grader, GRADER_PARAM):
        if judge.kind == "label_model":
            raise ProtocolError(LABEL_MODEL_REFUSAL, param=f"{param}.type", code="invalid_grader")
        if not judge_model(judge.model):
            raise ProtocolError(f"{param}.model: {judge.model!r} is not a model this server serves to you (GET "
                                "/v1/models lists them)", param=f"{param}.model", code="invalid_grader")
    try:
        return check_grader(grader, GRADER_PARAM, python=python, judges=True)
    except SettingsError as err:
        raise ProtocolError(err.message, param=err.param, code="invalid_grader") from None


LABEL_MODEL_REFUSAL = ("label_model is not a reinforcement grader, in OpenAI's API either (its reinforcement graders "
                       "are string_check, text_similarity, python, score_model and multi); use score_model")


def _lora(lora: LoRAParams | None, max_lora_rank: int | None) -> LoRASettings | None:
    """The typed LoRA settings (None: the server's default); what the trainer cannot do is refused here,
    naming the setting, not later as a failed job."""
    if lora is None:
        return None
    if max_lora_rank is not None and lora.r is not None and lora.r > max_lora_rank:
        raise ProtocolError(f"lora.r={lora.r} is above this server's max_lora_rank {max_lora_rank}",
                            param="lora.r", code="invalid_lora")
    try:
        return LoRASettings.from_dict(lora.model_dump(exclude_none=True))
    except SettingsError as err:
        raise ProtocolError(f"lora.{err.param}: {err.message}", param=f"lora.{err.param}",
                            code="invalid_lora") from None


def _training(params: TrainingParams | None, dedicated: DedicatedCapacity | None) -> TrainingRequest:
    """Where the job trains, with a dedicated run's workers filled in (the default: the cluster's)."""
    try:
        request = TrainingRequest.from_dict(params.model_dump(exclude_none=True) if params else {})
    except SettingsError as err:
        raise ProtocolError(err.message, param=err.param, code="invalid_training") from None
    if request.mode != TrainingMode.DEDICATED:
        return request
    if dedicated is None:
        raise ProtocolError("training.mode 'dedicated' runs the job on Ray Train, and this server runs "
                            "without Ray (--local); leave training out to train in the shared engine",
                            param="training.mode", code="dedicated_training_unavailable")
    workers = request.workers or dedicated.default_workers
    refusal = dedicated.refusal(workers)
    if refusal is not None:
        raise ProtocolError(f"{refusal}; ask for fewer workers", param="training.workers",
                            code="insufficient_cluster_capacity")
    return TrainingRequest(TrainingMode.DEDICATED, workers)
