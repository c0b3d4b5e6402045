"""Which fine-tuning jobs run on Ray Train of their own (`coserve.finetune.dedicated`): the `training`
request's strict rules, the operator's threshold, and the cluster capacity arithmetic."""

from __future__ import annotations

import pytest

from coserve.contract.job_request import TrainingMode, TrainingRequest
from coserve.contract.training_settings import SettingsError
from coserve.finetune.dedicated import DedicatedSettings, capacity, capacity_text, route


@pytest.mark.parametrize(("raw", "param"), [
    ({"mode": "gpu"}, "training.mode"),
    ({"mode": "dedicated", "workers": 0}, "training.workers"),
    ({"mode": "dedicated", "workers": 1025}, "training.workers"),
    ({"mode": "dedicated", "workers": 2.0}, "training.workers"),
    ({"mode": "dedicated", "workers": True}, "training.workers"),
    ({"mode": "coserved", "workers": 2}, "training.workers"),
    ({"workers": 2}, "training.workers"),
    ({"mode": "dedicated", "nodes": 2}, "training.nodes"),
])
def test_a_bad_training_request_names_its_param(raw: dict, param: str) -> None:
    with pytest.raises(SettingsError) as info:
        TrainingRequest.from_dict(raw)
    assert info.value.param == param


def test_the_request_round_trips_as_the_job_row_keeps_it() -> None:
    request = TrainingRequest.from_dict({"mode": "dedicated", "workers": 3})
    assert request.mode is TrainingMode.DEDICATED and request.to_dict() == {"mode": "dedicated", "workers": 3}
    assert TrainingRequest.from_dict(None) == TrainingRequest() and TrainingRequest().to_dict() == {}


def test_routing_by_request_and_by_the_operators_threshold() -> None:
    settings = DedicatedSettings(min_trained_tokens=1000, default_workers=4)
    asked = route(TrainingRequest.from_dict({"mode": "dedicated"}), 10, settings)
    assert asked.workers == 4 and asked.reason == "the job asked for a dedicated run on 4 worker(s)"
    assert route(TrainingRequest.from_dict({"mode": "dedicated", "workers": 2}), 10, settings).workers == 2
    big = route(TrainingRequest(), 1000, settings)
    assert big.dedicated and big.workers == 4
    assert "1000 trained tokens >= the server's dedicated threshold" in big.reason
    assert not route(TrainingRequest(), 999, settings).dedicated
    assert not route(TrainingRequest.from_dict({"mode": "coserved"}), 10**9, settings).dedicated  # opted out
    assert not route(TrainingRequest(), 10**9, DedicatedSettings()).dedicated  # no threshold: never routed
    assert not route(TrainingRequest(), 10**9, None).dedicated  # no Ray


def test_operator_settings_are_checked_as_flags() -> None:
    with pytest.raises(ValueError, match="--dedicated-min-tokens must be >= 1"):
        DedicatedSettings(min_trained_tokens=0)
    with pytest.raises(ValueError, match="--dedicated-workers must be in 1..1024"):
        DedicatedSettings(default_workers=0)
    assert DedicatedSettings(use_gpu=True).per_worker() == {"CPU": 1.0, "GPU": 1.0}


def test_capacity_counts_whole_workers_beyond_what_serving_holds() -> None:
    assert capacity({"CPU": 2.0}, {"CPU": 1.0}) == 2
    assert capacity({"CPU": 16.0, "GPU": 8.0}, {"CPU": 1.0, "GPU": 1.0}, {"GPU": 1.0}) == 7  # the engine's GPU
    assert capacity({"CPU": 16.0}, {"CPU": 1.0, "GPU": 1.0}) == 0  # no GPU at all
    assert capacity({"CPU": 2.5}, {"CPU": 1.0}) == 2 and capacity({}, {"CPU": 1.0}) == 0
    assert capacity_text({"CPU": 2.0, "memory": 5.0}, {"CPU": 1.0}, 2) == \
        "2 worker(s) of {'CPU': 1.0} (the cluster has {'CPU': 2.0})"
