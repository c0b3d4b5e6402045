"""A fine-tuning job as its client asked for it: the one typed spec of `POST /v1/fine_tuning/jobs`.

The gateway parses the body's shape (pydantic, `api/protocol/fine_tuning.py`) and builds a `JobRequest`
from it once; the request validates itself here (each refusal a `SettingsError` naming its param, the
400). The job row keeps it (`row`: OpenAI's `hyperparameters` and `method` columns, coserve's extensions),
and whoever reads the row back (the API's job object, the job manager that tokenizes and runs it, the
dedicated runs) reads it with `JobRequest.from_row`, which runs the same checks, so a row written by an
older server that no longer fits is refused the same way.

Methods: `supervised` (cross-entropy on the assistant tokens), `dpo` (a preference loss with `beta`,
the base model as reference) and `reinforcement` (GRPO on graded rollouts:
`contract.reinforcement`). The training mode (`training` extension): "coserved" in the shared
engines' iterations, "dedicated" on a Ray Train run of its own (`coserve.finetune.dedicated` routes).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from coserve.contract.loss_spec import DEFAULT_BETA, LossKind, LossSpec
from coserve.contract.reinforcement import ReinforcementRequest
from coserve.contract.training_settings import HyperparameterRequest, LoRASettings, SettingsError

TRAINING_KEY = "training"  # the job row's extension holding {"mode": ..., "workers": ...}
LORA_KEY = "lora"  # the job row's extension holding the LoRA settings the client gave
MAX_WORKERS = 1024


class FineTuningMethod(str, enum.Enum):
    SUPERVISED = "supervised"
    DPO = "dpo"
    REINFORCEMENT = "reinforcement"


class TrainingMode(str, enum.Enum):
    COSERVED = "coserved"  # in the engines' iterations, next to inference (the default)
    DEDICATED = "dedicated"  # a Ray Train TorchTrainer of its own (data parallel over `workers`)


@dataclass(frozen=True, slots=True)
class TrainingRequest:
    """Where the job asked to train (`training` extension); None fields: not given.

    Raises:
        SettingsError: an unknown mode, workers that are not an integer in 1..MAX_WORKERS, or workers
            with the co-served mode (it has no workers to size); `param` is `training.<name>`.
    """

    mode: TrainingMode | None = None
    workers: int | None = None

    def __post_init__(self) -> None:
        if self.mode is not None and not isinstance(self.mode, TrainingMode):
            try:
                object.__setattr__(self, "mode", TrainingMode(self.mode))
            except ValueError:
                raise SettingsError("training.mode", f"training.mode must be one of "
                                    f"{[m.value for m in TrainingMode]}, got {self.mode!r}") from None
        if self.workers is not None and (type(self.workers) is not int
                                         or not 1 <= self.workers <= MAX_WORKERS):
            raise SettingsError("training.workers", f"training.workers must be an integer in "
                                f"1..{MAX_WORKERS}, got {self.workers!r}")
        if self.workers is not None and self.mode != TrainingMode.DEDICATED:
            raise SettingsError("training.workers", "training.workers sizes a dedicated run: give it "
                                "with training.mode \"dedicated\"")

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any] | None) -> TrainingRequest:
        """From the request's (or the job row's) JSON; None or {} asks for nothing.

        Raises:
            SettingsError: an unknown key, or what `__post_init__` refuses.
        """
        raw = raw or {}
        unknown = sorted(set(raw) - {"mode", "workers"})
        if unknown:
            raise SettingsError(f"training.{unknown[0]}", f"unknown training setting(s) {unknown}; "
                                                          f"use ['mode', 'workers']")
        return cls(**{k: v for k, v in raw.items() if v is not None})

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.mode is not None:
            out["mode"] = self.mode.value
        if self.workers is not None:
            out["workers"] = self.workers
        return out


@dataclass(frozen=True, slots=True)
class JobRow:
    """What the job row keeps of a request (the store's `hyperparameters`, `method`, `extensions`)."""

    hyperparameters: dict[str, Any]
    method: dict[str, Any]
    extensions: dict[str, Any]


@dataclass(frozen=True, slots=True)
class JobRequest:
    """The method, hyperparameters (None: "auto"), LoRA settings (None: the server's default) and
    training mode of a job.

    Raises:
        SettingsError: `beta` on a supervised job, or what the parts refuse; `param` names it.
    """

    method: FineTuningMethod = FineTuningMethod.SUPERVISED
    hyperparameters: HyperparameterRequest = field(default_factory=HyperparameterRequest)
    beta: float | None = None  # dpo only
    lora: LoRASettings | None = None
    training: TrainingRequest = field(default_factory=TrainingRequest)
    reinforcement: ReinforcementRequest | None = None  # the reinforcement method's grader and settings

    def __post_init__(self) -> None:
        if self.beta is not None and self.method != FineTuningMethod.DPO:
            raise SettingsError(f"method.{self.method.value}.hyperparameters.beta",
                                f"beta is a DPO hyperparameter; a {self.method.value} job has none")
        if (self.reinforcement is not None) != (self.method == FineTuningMethod.REINFORCEMENT):
            raise SettingsError("method.reinforcement", "a reinforcement job needs method.reinforcement "
                                "with its grader, and only a reinforcement job has one")
        if self.reinforcement is not None and self.training.mode == TrainingMode.DEDICATED:
            raise SettingsError("training.mode", "a reinforcement job samples its rollouts from the adapter it "
                                "trains, in the shared engines: it cannot run dedicated; leave training out")
        if self.beta is not None:
            LossSpec(LossKind.DPO, beta=self.beta)  # raises SettingsError("beta") when out of range
            object.__setattr__(self, "beta", float(self.beta))

    def loss(self) -> LossSpec:
        """The loss the job trains with."""
        if self.method == FineTuningMethod.DPO:
            return LossSpec(LossKind.DPO, beta=DEFAULT_BETA if self.beta is None else self.beta)
        if self.method == FineTuningMethod.REINFORCEMENT:
            return LossSpec(LossKind.IMPORTANCE_SAMPLING)
        return LossSpec(LossKind.CROSS_ENTROPY)

    def method_json(self, hyperparameters: Mapping[str, Any]) -> dict[str, Any]:
        """OpenAI's `method` object, with `hyperparameters` (as given, or resolved), DPO's beta, and a
        reinforcement job's grader and its own hyperparameters."""
        hp = dict(hyperparameters)
        if self.method == FineTuningMethod.DPO:
            hp["beta"] = "auto" if self.beta is None else self.beta
        settings: dict[str, Any] = {"hyperparameters": hp}
        if self.reinforcement is not None:
            hp.update(self.reinforcement.hyperparameters_json())
            settings["grader"] = dict(self.reinforcement.grader)
            if self.reinforcement.max_completion_tokens is not None:
                settings["max_completion_tokens"] = self.reinforcement.max_completion_tokens
        return {"type": self.method.value, self.method.value: settings}

    def row(self) -> JobRow:
        extensions: dict[str, Any] = {}
        if self.lora is not None:
            extensions[LORA_KEY] = self.lora.to_dict()
        if self.training.to_dict():
            extensions[TRAINING_KEY] = self.training.to_dict()
        method: dict[str, Any] = {"type": self.method.value}
        if self.beta is not None:
            method["beta"] = self.beta
        if self.reinforcement is not None:
            method["reinforcement"] = self.reinforcement.to_dict()
        return JobRow(self.hyperparameters.to_dict(), method, extensions)

    @classmethod
    def from_row(cls, hyperparameters: Mapping[str, Any], method: Mapping[str, Any] | None,
                 extensions: Mapping[str, Any]) -> JobRequest:
        """From a job row (a row without `method`, from before there were methods, is supervised).

        Raises:
            SettingsError: a value the request would refuse.
        """
        method = method or {}
        try:
            kind = FineTuningMethod(method.get("type", FineTuningMethod.SUPERVISED.value))
        except ValueError:
            raise SettingsError("method.type", f"unknown method {method.get('type')!r}") from None
        lora = extensions.get(LORA_KEY)
        reinforcement = method.get("reinforcement")
        return cls(method=kind, hyperparameters=HyperparameterRequest.from_dict(hyperparameters),
                   beta=method.get("beta"), lora=None if lora is None else LoRASettings.from_dict(lora),
                   training=TrainingRequest.from_dict(extensions.get(TRAINING_KEY)),
                   reinforcement=None if reinforcement is None else ReinforcementRequest.from_dict(reinforcement))
