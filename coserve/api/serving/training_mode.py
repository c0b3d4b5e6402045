"""Where a fine-tuning job trains, from the request's `training` extension: the job row's `training` entry,
or a 400 naming the param (`coserve.finetune.dedicated`: the rules; `coserve.dedicated`: the runs).

A dedicated run needs Ray: on a `--local` server asking for one is a 400 `dedicated_training_unavailable`
(param `training.mode`). On Ray, a run that asks for more workers than the cluster can ever place at once
is a 400 `insufficient_cluster_capacity` (param `training.workers`) naming the cluster's resources: it
would otherwise wait forever.
"""

from __future__ import annotations

from typing import Any, Protocol

from coserve.api.protocol.base import ProtocolError
from coserve.api.protocol.fine_tuning import TrainingParams
from coserve.contract.training_settings import SettingsError
from coserve.finetune.dedicated import TrainingMode, TrainingRequest


class DedicatedCapacity(Protocol):
    """The cluster's room for dedicated workers (`coserve.dedicated.capacity.ClusterCapacity`)."""

    @property
    def default_workers(self) -> int: ...

    def refusal(self, workers: int) -> str | None:
        """Why `workers` workers can never run at once (None: they can)."""


def training_extension(params: TrainingParams | None, dedicated: DedicatedCapacity | None) -> dict[str, Any] | None:
    """The `training` entry to keep in the job row (None: the client asked for nothing; the operator's
    threshold may route the job once its file is tokenized).

    Raises:
        ProtocolError: 400 naming `training.mode` or `training.workers` (see the module docstring).
    """
    try:
        request = TrainingRequest.from_dict(params.model_dump(exclude_none=True) if params else {})
    except SettingsError as err:
        raise ProtocolError(err.message, param=err.param, code="invalid_training") from None
    if request.mode != TrainingMode.DEDICATED:
        return request.to_dict() or None
    if dedicated is None:
        raise ProtocolError("training.mode 'dedicated' runs the job on Ray Train, and this server runs "
                            "without Ray (--local); leave training out to train in the shared engine",
                            param="training.mode", code="dedicated_training_unavailable")
    workers = request.workers or dedicated.default_workers
    refusal = dedicated.refusal(workers)
    if refusal is not None:
        raise ProtocolError(f"{refusal}; ask for fewer workers", param="training.workers",
                            code="insufficient_cluster_capacity")
    return {"mode": TrainingMode.DEDICATED.value, "workers": workers}
