"""The one typed job request (`coserve.contract.job_request`): what the row keeps reads back the same,
rows from before methods existed still load, and what a request may not hold is refused naming it."""

from __future__ import annotations

import pytest

from coserve.contract.job_request import FineTuningMethod, JobRequest, TrainingMode, TrainingRequest
from coserve.contract.loss_spec import DEFAULT_BETA, LossKind
from coserve.contract.training_settings import HyperparameterRequest, LoRASettings, SettingsError


def test_a_request_reads_back_from_its_row() -> None:
    request = JobRequest(FineTuningMethod.DPO, HyperparameterRequest(n_epochs=2), beta=0.5,
                         lora=LoRASettings(r=8, target_modules=("v_proj", "q_proj")),
                         training=TrainingRequest(TrainingMode.COSERVED))
    row = request.row()
    assert row.method == {"type": "dpo", "beta": 0.5}
    assert row.extensions["training"] == {"mode": "coserved"}
    assert JobRequest.from_row(row.hyperparameters, row.method, row.extensions) == request
    assert request.loss().kind == LossKind.DPO and request.loss().beta == 0.5
    assert request.method_json({"n_epochs": 2}) == {"type": "dpo", "dpo": {"hyperparameters": {
        "n_epochs": 2, "beta": 0.5}}}


def test_a_dedicated_supervised_request_reads_back_from_its_row() -> None:
    request = JobRequest(training=TrainingRequest(TrainingMode.DEDICATED, 3))
    row = request.row()
    assert row.extensions["training"] == {"mode": "dedicated", "workers": 3}
    assert JobRequest.from_row(row.hyperparameters, row.method, row.extensions) == request


def test_rows_written_before_methods_existed_are_supervised_jobs() -> None:
    legacy = JobRequest.from_row({"n_epochs": "auto", "batch_size": 4, "learning_rate_multiplier": "auto"},
                                 None, {"lora": {"r": 4}})
    assert legacy.method == FineTuningMethod.SUPERVISED and legacy.hyperparameters.batch_size == 4
    assert legacy.lora == LoRASettings(r=4) and legacy.training == TrainingRequest()
    assert legacy.loss().kind == LossKind.CROSS_ENTROPY
    assert JobRequest(FineTuningMethod.DPO).loss().beta == DEFAULT_BETA  # "auto"
    dedicated = JobRequest(FineTuningMethod.DPO, beta=0.2, training=TrainingRequest(TrainingMode.DEDICATED, 2))
    row = dedicated.row()  # a DPO job may run on Ray Train too
    assert JobRequest.from_row(row.hyperparameters, row.method, row.extensions) == dedicated


@pytest.mark.parametrize(("build", "param"), [
    (lambda: JobRequest(beta=0.1), "method.supervised.hyperparameters.beta"),
    (lambda: JobRequest(FineTuningMethod.DPO, beta=0.0), "beta"),
    (lambda: JobRequest(FineTuningMethod.DPO, beta=11.0), "beta"),
    (lambda: JobRequest.from_row({}, {"type": "rlhf"}, {}), "method.type"),
    (lambda: JobRequest.from_row({"n_epoch": 1}, None, {}), "n_epoch"),
    (lambda: JobRequest.from_row({}, None, {"training": {"workers": 2}}), "training.workers"),
])
def test_what_a_request_may_not_hold_is_refused_naming_it(build, param: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(SettingsError) as info:
        build()
    assert info.value.param == param
