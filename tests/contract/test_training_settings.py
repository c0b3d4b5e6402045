"""The typed fine-tuning settings: one set of defaults, each validation error naming its param, JSON
round trips, and stored rows of the older shape (partial PEFT dicts) still loading."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from typing import Any

import pytest

from coserve.contract.training_settings import (
    BASE_LEARNING_RATE,
    TARGET_MODULES,
    LoRASettings,
    OptimizerSettings,
    SettingsError,
    TooFewExamplesError,
    resolve_hyperparameters,
)


def test_defaults() -> None:
    lora = LoRASettings()
    assert (lora.r, lora.lora_alpha, lora.lora_dropout, lora.use_rslora) == (16, 32.0, 0.0, False)
    assert lora.target_modules == TARGET_MODULES and lora.scale == 2.0
    opt = OptimizerSettings()
    assert opt.learning_rate == BASE_LEARNING_RATE == 1e-4
    assert (opt.weight_decay, opt.betas, opt.eps, opt.max_grad_norm) == (0.0, (0.9, 0.999), 1e-8, 1.0)


def test_rslora_scales_by_the_square_root_of_the_rank() -> None:
    assert LoRASettings(r=16, lora_alpha=8, use_rslora=True).scale == pytest.approx(2.0)
    assert LoRASettings(r=16, lora_alpha=8).scale == pytest.approx(0.5)


def test_target_modules_are_put_in_the_engine_order_without_duplicates() -> None:
    lora = LoRASettings(target_modules=["v_proj", "q_proj", "v_proj"])  # type: ignore[arg-type]
    assert lora.target_modules == ("q_proj", "v_proj")
    assert LoRASettings(target_modules="o_proj").target_modules == ("o_proj",)  # type: ignore[arg-type]


@pytest.mark.parametrize("kwargs, param", [
    ({"r": 0}, "r"), ({"r": 2.0}, "r"), ({"r": True}, "r"),
    ({"lora_alpha": 0}, "lora_alpha"), ({"lora_alpha": math.inf}, "lora_alpha"),
    ({"lora_alpha": "8"}, "lora_alpha"), ({"lora_dropout": 0.1}, "lora_dropout"),
    ({"target_modules": ()}, "target_modules"), ({"target_modules": ("fc1",)}, "target_modules"),
    ({"use_rslora": 1}, "use_rslora"),
])
def test_each_bad_lora_setting_is_a_settings_error_naming_it(kwargs: dict[str, Any], param: str) -> None:
    with pytest.raises(SettingsError) as err:
        LoRASettings(**kwargs)
    assert err.value.param == param and param in err.value.message


@pytest.mark.parametrize("kwargs, param", [
    ({"learning_rate_multiplier": 0}, "learning_rate_multiplier"), ({"weight_decay": -1}, "weight_decay"),
    ({"betas": (0.9, 1.0)}, "betas"), ({"eps": 0}, "eps"), ({"max_grad_norm": math.nan}, "max_grad_norm"),
])
def test_each_bad_optimizer_setting_is_a_settings_error_naming_it(kwargs: dict[str, Any],
                                                                 param: str) -> None:
    with pytest.raises(SettingsError) as err:
        OptimizerSettings(**kwargs)
    assert err.value.param == param and "bad optimizer settings" in err.value.message


def test_unknown_names_are_refused_by_name() -> None:
    with pytest.raises(SettingsError) as err:
        LoRASettings.from_dict({"r": 4, "rank": 4})
    assert err.value.param == "rank" and "unknown LoRA setting" in str(err.value)
    with pytest.raises(SettingsError) as err:
        OptimizerSettings.from_dict({"lr": 1.0})
    assert err.value.param == "lr"


def test_json_round_trips() -> None:
    lora = LoRASettings(r=4, lora_alpha=8, target_modules=("q_proj", "v_proj"), use_rslora=True)
    assert LoRASettings.from_dict(json.loads(json.dumps(lora.to_dict()))) == lora
    opt = OptimizerSettings(learning_rate_multiplier=2.5, max_grad_norm=math.inf, betas=(0.8, 0.99))
    assert OptimizerSettings.from_dict(json.loads(json.dumps(opt.to_dict()))) == opt


def test_rows_of_the_older_shape_load_with_the_defaults_filled_in() -> None:
    """The LoRA extension of a job row is the request's partial PEFT dict (no `use_rslora`, nulls
    allowed); the pre-settings optimizer dict had no unknown keys either."""
    assert LoRASettings.from_dict({"r": 8}) == LoRASettings(r=8)
    assert LoRASettings.from_dict({"r": 8, "lora_alpha": 16.0, "lora_dropout": 0.0,
                                   "target_modules": ["q_proj", "v_proj"]}) == \
        LoRASettings(r=8, lora_alpha=16, target_modules=("q_proj", "v_proj"))
    assert LoRASettings.from_dict({"r": None, "lora_alpha": None}) == LoRASettings()
    old_optimizer = {"learning_rate_multiplier": 1.0, "weight_decay": 0.0, "betas": [0.9, 0.999],
                     "eps": 1e-8, "max_grad_norm": 1.0}
    assert OptimizerSettings.from_dict(old_optimizer) == OptimizerSettings()


def test_hyperparameter_errors_are_typed() -> None:
    with pytest.raises(TooFewExamplesError) as few:
        resolve_hyperparameters({}, num_examples=9, num_trained_tokens=100)
    assert few.value.param == "training_file"
    with pytest.raises(SettingsError) as err:
        resolve_hyperparameters({"batch_size": 0}, num_examples=10, num_trained_tokens=100)
    assert err.value.param == "batch_size" and not isinstance(err.value, TooFewExamplesError)
    with pytest.raises(SettingsError) as err:
        resolve_hyperparameters({"epochs": 3}, num_examples=10, num_trained_tokens=100)
    assert err.value.param == "epochs"
    resolved = resolve_hyperparameters({"learning_rate_multiplier": 3}, num_examples=10,
                                       num_trained_tokens=100)
    assert resolved.optimizer_settings() == OptimizerSettings(learning_rate_multiplier=3.0)


def test_the_settings_module_imports_no_torch() -> None:
    code = "import sys, coserve.contract.training_settings; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_hyperparameter_request_reads_and_writes_openai_json() -> None:
    from coserve.contract.training_settings import HyperparameterRequest

    request = HyperparameterRequest.from_dict({"n_epochs": 2, "batch_size": "auto",
                                               "learning_rate_multiplier": None})
    assert request == HyperparameterRequest(n_epochs=2)
    assert request.to_dict() == {"n_epochs": 2, "batch_size": "auto", "learning_rate_multiplier": "auto"}
    assert HyperparameterRequest.from_dict(request.to_dict()) == request
    assert HyperparameterRequest(learning_rate_multiplier=2).learning_rate_multiplier == 2.0
    for raw, param in (({"n_epochs": 51}, "n_epochs"), ({"batch_size": True}, "batch_size"),
                       ({"learning_rate_multiplier": 10.5}, "learning_rate_multiplier"),
                       ({"lr": 1}, "lr")):
        with pytest.raises(SettingsError) as err:
            HyperparameterRequest.from_dict(raw)
        assert err.value.param == param
    resolved = HyperparameterRequest(batch_size=4).resolve(num_examples=10, num_trained_tokens=100)
    assert (resolved.batch_size, resolved.n_epochs, resolved.steps_per_epoch) == (4, 10, 3)
