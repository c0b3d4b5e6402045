"""The body of `POST /v1/fine_tuning/jobs` as the one typed `JobRequest` (`coserve.contract.job_request`),
or a 400 naming the param. The only place a job request is parsed: the row keeps what this returns.

What is refused here, before the job exists:
- a value the request's types refuse (`SettingsError`): 400 naming the param (`code` `invalid_lora`
  for a LoRA setting, `invalid_training` for the training extension);
- `lora.r` above this server's `max_lora_rank`;
- a dedicated run (`training.mode` "dedicated") on a `--local` server: `dedicated_training_unavailable`;
  on Ray, more workers than the cluster can ever place at once: `insufficient_cluster_capacity`
  (param `training.workers`) naming the cluster's resources (it would otherwise wait forever).
"""

from __future__ import annotations

from typing import Protocol

from coserve.api.protocol.base import ProtocolError
from coserve.api.protocol.fine_tuning import FineTuningJobCreate, LoRAParams, TrainingParams
from coserve.contract.job_request import FineTuningMethod, JobRequest, TrainingMode, TrainingRequest
from coserve.contract.training_settings import HYPERPARAMETERS, HyperparameterRequest, LoRASettings, SettingsError


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
        return JobRequest(method=method, hyperparameters=hyperparameters,
                          beta=None if beta == "auto" else beta,
                          lora=_lora(body.lora, max_lora_rank),
                          training=_training(body.training, dedicated))
    except SettingsError as err:
        raise ProtocolError(err.message, param=err.param) from None


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
