"""The typed contract of a fine-tuning job's settings: LoRA, optimizer, hyperparameters ("auto" rules).

One torch-free module, one set of defaults, validated once: the gateway builds these from a request
(turning a `SettingsError` into a 400 naming the param), the offline `LLM.fine_tune` from its
arguments, the job manager from a stored job row; the job spec, the plan's `JobStart` and the engine's
trainer take the dataclasses as they are. The store keeps them as JSON (`to_dict` / `from_dict`): the
LoRA extension holds the settings the client gave (`from_dict` fills the defaults), so rows written
before these types existed load unchanged.

Defaults: LoRA r=16, lora_alpha=32, no dropout, every projection (`TARGET_MODULES`); AdamW with learning
rate 1e-4 x `learning_rate_multiplier`, weight decay 0 (HF's and OpenAI's default; decay on LoRA's B
pulls it towards the base model), AdamW's betas and eps, clipping at a total norm of 1.0. "auto"
epochs and batch size follow `HyperparameterRequest.resolve`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

# The projections a LoRA may target (PEFT names), in the engine's canonical order.
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
BASE_LEARNING_RATE = 1e-4
MIN_EXAMPLES = 10  # OpenAI refuses smaller training files
HYPERPARAMETERS = ("n_epochs", "batch_size", "learning_rate_multiplier")


class SettingsError(ValueError):
    """A setting that cannot be used; `param` names it (PEFT's or OpenAI's name, e.g. `lora_dropout`)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param, self.message = param, message


class TooFewExamplesError(SettingsError):
    """The training file has fewer than `MIN_EXAMPLES` usable examples (`invalid_n_examples`)."""

    def __init__(self, num_examples: int) -> None:
        super().__init__("training_file", f"Training file has {num_examples} example(s), but must have "
                                          f"at least {MIN_EXAMPLES} examples")


def _finite_number(value: Any) -> bool:
    return type(value) in (int, float) and math.isfinite(value)


@dataclass(frozen=True, slots=True)
class LoRASettings:
    """A trainable LoRA's settings, with PEFT's `LoraConfig` names."""

    r: int = 16
    lora_alpha: float = 32.0
    lora_dropout: float = 0.0
    target_modules: tuple[str, ...] = TARGET_MODULES
    use_rslora: bool = False  # scale alpha / sqrt(r) instead of alpha / r

    def __post_init__(self) -> None:
        if type(self.r) is not int or self.r < 1:
            raise SettingsError("r", f"LoRA rank r must be an integer >= 1, got {self.r!r}")
        if not (_finite_number(self.lora_alpha) and self.lora_alpha > 0):
            raise SettingsError("lora_alpha", f"lora_alpha must be a finite number > 0, got "
                                              f"{self.lora_alpha!r}")
        if self.lora_dropout != 0.0:
            # Dropout would need the same mask in the forward window and in the recompute; not yet.
            raise SettingsError("lora_dropout", f"lora_dropout={self.lora_dropout} is not supported "
                                                f"yet; use 0")
        modules = (self.target_modules,) if isinstance(self.target_modules, str) else self.target_modules
        unknown = sorted(set(modules) - set(TARGET_MODULES))
        if unknown or not modules:
            raise SettingsError("target_modules", f"target_modules must be a non-empty subset of "
                                                  f"{list(TARGET_MODULES)}; got {list(modules)}")
        if type(self.use_rslora) is not bool:
            raise SettingsError("use_rslora", f"use_rslora must be true or false, got {self.use_rslora!r}")
        object.__setattr__(self, "lora_alpha", float(self.lora_alpha))
        # Canonical order (the engine's), no duplicates: keeps init and file order deterministic.
        object.__setattr__(self, "target_modules", tuple(m for m in TARGET_MODULES if m in modules))

    @property
    def scale(self) -> float:
        """PEFT's `scaling`: alpha / r, or alpha / sqrt(r) with rsLoRA."""
        return self.lora_alpha / (math.sqrt(self.r) if self.use_rslora else self.r)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready settings (PEFT names)."""
        return {**asdict(self), "target_modules": list(self.target_modules)}

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> LoRASettings:
        """Settings from PEFT-named JSON; absent or null ones keep the defaults.

        Raises:
            SettingsError: an unknown name or a value `__post_init__` refuses.
        """
        return cls(**_known(cls, raw, "LoRA setting(s)"))


@dataclass(frozen=True, slots=True)
class OptimizerSettings:
    """AdamW hyperparameters of a job (module docstring: why these defaults)."""

    learning_rate_multiplier: float = 1.0
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    max_grad_norm: float = 1.0  # math.inf turns clipping off

    def __post_init__(self) -> None:
        object.__setattr__(self, "betas", tuple(float(b) for b in self.betas))
        problems = []
        if not (math.isfinite(self.learning_rate_multiplier) and self.learning_rate_multiplier > 0):
            problems.append(("learning_rate_multiplier",
                             f"learning_rate_multiplier={self.learning_rate_multiplier} (need > 0)"))
        if not (math.isfinite(self.weight_decay) and self.weight_decay >= 0):
            problems.append(("weight_decay", f"weight_decay={self.weight_decay} (need >= 0)"))
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            problems.append(("betas", f"betas={self.betas} (need two values in [0, 1))"))
        if not self.eps > 0:
            problems.append(("eps", f"eps={self.eps} (need > 0)"))
        if not self.max_grad_norm > 0:  # NaN fails this too
            problems.append(("max_grad_norm", f"max_grad_norm={self.max_grad_norm} (need > 0)"))
        if problems:
            raise SettingsError(problems[0][0], "bad optimizer settings: "
                                + "; ".join(text for _, text in problems))

    @property
    def learning_rate(self) -> float:
        """1e-4 x `learning_rate_multiplier`."""
        return BASE_LEARNING_RATE * self.learning_rate_multiplier

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready settings (inf stays a float: `json` writes it as `Infinity`)."""
        return {**asdict(self), "betas": list(self.betas)}

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> OptimizerSettings:
        """Settings from `to_dict`'s JSON; absent ones keep the defaults."""
        return cls(**_known(cls, raw, "optimizer setting(s)"))


@dataclass(frozen=True, slots=True)
class AdamStep:
    """One optimizer step's own AdamW hyperparameters: a driven run's client sends them with each step
    (Tinker's `AdamParams`; `grad_clip_norm` 0 turns clipping off).

    Raises:
        SettingsError: a value AdamW cannot take; `param` names it.
    """

    learning_rate: float
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0

    def __post_init__(self) -> None:
        checks = {"learning_rate": math.isfinite(self.learning_rate) and self.learning_rate >= 0,
                  "beta1": 0.0 <= self.beta1 < 1.0, "beta2": 0.0 <= self.beta2 < 1.0,
                  "eps": math.isfinite(self.eps) and self.eps > 0,
                  "weight_decay": math.isfinite(self.weight_decay) and self.weight_decay >= 0,
                  "grad_clip_norm": math.isfinite(self.grad_clip_norm) and self.grad_clip_norm >= 0}
        for name, ok in checks.items():
            if not ok:
                raise SettingsError(name, f"AdamW cannot take {name}={getattr(self, name)!r}")

    @property
    def max_grad_norm(self) -> float:
        return self.grad_clip_norm if self.grad_clip_norm > 0 else math.inf


def _known(cls: type, raw: Mapping[str, Any], what: str) -> dict[str, Any]:
    """`raw`'s non-null entries as `cls`'s arguments; an unknown name is a `SettingsError`."""
    names = [f.name for f in fields(cls)]
    unknown = sorted(set(raw) - set(names))
    if unknown:
        raise SettingsError(unknown[0], f"unknown {what} {unknown}; use {names}")
    return {k: v for k, v in raw.items() if v is not None}


# "auto" epochs: OpenAI cookbook "Data preparation and analysis for chat model fine-tuning".
TARGET_EPOCHS = 3
MIN_TARGET_EXAMPLES = 100  # fewer examples: more epochs, so that the job sees ~100 examples
MAX_TARGET_EXAMPLES = 25_000  # more examples: fewer epochs, so that the job sees ~25k examples
MAX_AUTO_EPOCHS = 25
AUTO_BATCH_FRACTION = 0.002  # "auto" batch ~0.2% of the examples, as OpenAI's chosen values suggest
BOUNDS = {"n_epochs": (1, 50), "batch_size": (1, 256)}
MAX_LEARNING_RATE_MULTIPLIER = 10.0  # coserve's cap (api/protocol/fine_tuning.py)


@dataclass(frozen=True, slots=True)
class ResolvedHyperparameters:
    """The job's hyperparameters with every "auto" replaced by a value."""

    n_epochs: int
    batch_size: int
    learning_rate_multiplier: float
    learning_rate: float  # BASE_LEARNING_RATE (1e-4) x learning_rate_multiplier
    steps_per_epoch: int
    total_steps: int
    total_trained_tokens: int  # trained targets over all epochs (the job's `trained_tokens`)

    def optimizer_settings(self) -> OptimizerSettings:
        """The optimizer settings these hyperparameters imply (other settings at their defaults)."""
        return OptimizerSettings(learning_rate_multiplier=self.learning_rate_multiplier)


def auto_n_epochs(num_examples: int) -> int:
    """3 epochs; small files get more (up to 25) and big ones fewer, aiming at 100..25k example visits."""
    if num_examples * TARGET_EPOCHS < MIN_TARGET_EXAMPLES:
        return min(MAX_AUTO_EPOCHS, math.ceil(MIN_TARGET_EXAMPLES / num_examples))
    if num_examples * TARGET_EPOCHS > MAX_TARGET_EXAMPLES:
        return max(1, MAX_TARGET_EXAMPLES // num_examples)
    return TARGET_EPOCHS


def auto_batch_size(num_examples: int) -> int:
    """About 0.2% of the examples, within [1, 256]."""
    return max(1, min(BOUNDS["batch_size"][1], round(num_examples * AUTO_BATCH_FRACTION)))


def _integer_param(name: str, value: Any) -> int:
    low, high = BOUNDS[name]
    # `type is int`: bool is an int subclass and 3.0 is not an integer hyperparameter.
    if type(value) is not int or not low <= value <= high:
        raise SettingsError(name, f"invalid hyperparameter '{name}': {value!r}; expected \"auto\" or "
                                  f"an integer in [{low}, {high}]")
    return value


def _multiplier_param(value: Any) -> float:
    if not _finite_number(value) or not 0 < value <= MAX_LEARNING_RATE_MULTIPLIER:
        raise SettingsError("learning_rate_multiplier", f"invalid hyperparameter "
                            f"'learning_rate_multiplier': {value!r}; expected \"auto\" or a number in "
                            f"(0, {MAX_LEARNING_RATE_MULTIPLIER:g}]")
    return float(value)


@dataclass(frozen=True, slots=True)
class HyperparameterRequest:
    """The hyperparameters a job asks for; None is "auto" (`resolve` picks it from the training file).

    Raises:
        SettingsError: a value outside OpenAI's bounds (n_epochs 1..50, batch_size 1..256,
            multiplier in (0, 10]); `param` names it.
    """

    n_epochs: int | None = None
    batch_size: int | None = None
    learning_rate_multiplier: float | None = None

    def __post_init__(self) -> None:
        for name in ("n_epochs", "batch_size"):
            if getattr(self, name) is not None:
                _integer_param(name, getattr(self, name))
        if self.learning_rate_multiplier is not None:
            object.__setattr__(self, "learning_rate_multiplier",
                               _multiplier_param(self.learning_rate_multiplier))

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> HyperparameterRequest:
        """From OpenAI's JSON (a job row's `hyperparameters`): "auto", null or absent is None."""
        unknown = sorted(set(raw) - set(HYPERPARAMETERS))
        if unknown:
            raise SettingsError(unknown[0], f"unknown hyperparameter(s) {unknown}")
        return cls(**{k: None if v == "auto" else v for k, v in raw.items()})

    def to_dict(self) -> dict[str, Any]:
        """OpenAI's JSON: "auto" for None (the shape a job row keeps and the API echoes)."""
        return {name: "auto" if value is None else value for name, value in asdict(self).items()}

    def resolve(self, num_examples: int, num_trained_tokens: int) -> ResolvedHyperparameters:
        """Replace "auto" by coserve's rules.

        `num_examples` is the number of trainable sequences (after skipping) and `num_trained_tokens`
        their trained targets per epoch. Rules for "auto":

        * n_epochs: 3, as OpenAI's default. When 3 epochs would show the model fewer than 100 examples,
          ceil(100 / num_examples) epochs (at most 25): a 10-example file gets 10 epochs, since a few
          dozen steps teach a LoRA nothing. When 3 epochs would exceed 25,000 examples,
          25,000 // num_examples epochs (at least 1): big files need fewer passes. (OpenAI cookbook.)
        * batch_size: round(0.2% of num_examples) within [1, 256], the proportion OpenAI's auto batch
          sizes are reported to follow: small datasets keep one optimizer step per example or two,
          big ones get less noisy gradients while keeping about 500 steps per epoch (more past 256).
        * learning_rate_multiplier: 1.0, so learning rate = 1e-4, the usual LoRA rate (issue 3's rule).

        Raises:
            TooFewExamplesError: fewer than 10 examples.
            SettingsError: no trained token (param `training_file`).
        """
        if num_examples < MIN_EXAMPLES:
            raise TooFewExamplesError(num_examples)
        if num_trained_tokens <= 0:
            raise SettingsError("training_file", "the training examples have no trainable assistant token")
        n_epochs = auto_n_epochs(num_examples) if self.n_epochs is None else self.n_epochs
        batch_size = auto_batch_size(num_examples) if self.batch_size is None else self.batch_size
        multiplier = 1.0 if self.learning_rate_multiplier is None else self.learning_rate_multiplier
        steps_per_epoch = math.ceil(num_examples / batch_size)  # the last batch of an epoch may be short
        return ResolvedHyperparameters(n_epochs=n_epochs, batch_size=batch_size,
                                       learning_rate_multiplier=multiplier,
                                       learning_rate=BASE_LEARNING_RATE * multiplier,
                                       steps_per_epoch=steps_per_epoch,
                                       total_steps=steps_per_epoch * n_epochs,
                                       total_trained_tokens=num_trained_tokens * n_epochs)


def resolve_hyperparameters(requested: Mapping[str, Any], num_examples: int,
                            num_trained_tokens: int) -> ResolvedHyperparameters:
    """`HyperparameterRequest.from_dict(requested).resolve(...)`: OpenAI's JSON to values.

    Raises:
        TooFewExamplesError, SettingsError: as `from_dict` and `resolve`.
    """
    return HyperparameterRequest.from_dict(requested).resolve(num_examples, num_trained_tokens)
