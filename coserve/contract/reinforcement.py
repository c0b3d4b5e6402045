"""Reinforcement fine-tuning as a client asks for it and as the scheduler runs it. Pure data.

`ReinforcementRequest` is OpenAI's `method.reinforcement` (its grader and the hyperparameters beyond the
supervised ones) as the job row keeps it. Its meanings on coserve:

* `compute_multiplier` scales GRPO's group: each prompt is sampled `round(4 * compute_multiplier)` times
  (2 to 32: a group needs two samples to compare, and a group of 32 is already 8x the default);
* `eval_interval`: the steps between evaluations on the validation file ("auto": about ten evaluations
  per job); the base model (step 0) and the final model are evaluated too;
* `eval_samples`: completions sampled per validation prompt at each evaluation ("auto": 1);
* `reasoning_effort`: only "default". The models coserve serves have no reasoning mode to turn up;
* `max_completion_tokens` (coserve extension): the longest rollout, in tokens (default 256).

`RolloutSpec` is what a running job's rollout loop needs (`coserve.finetune.rollouts`): the grader, the rows
its templates read, the group size, the validation prompts. `RolloutGrading` is how the loop has its
samples graded, off its thread (`coserve.graders.rollout_grading`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol

from coserve.contract.grader import Grader, parse_grader
from coserve.contract.training_settings import SettingsError

PARAM = "method.reinforcement"
HYPERPARAMETERS_PARAM = f"{PARAM}.hyperparameters"
BASE_SAMPLES = 4  # completions per prompt at compute_multiplier 1
MIN_SAMPLES, MAX_SAMPLES = 2, 32
MAX_EVAL_SAMPLES = 32
MAX_EVAL_INTERVAL = 100_000
DEFAULT_MAX_COMPLETION_TOKENS = 256
MAX_COMPLETION_TOKENS = 32_768
EVALUATIONS_PER_JOB = 10  # "auto" eval_interval: about this many evaluations
REASONING_EFFORTS = ("default", "low", "medium", "high")  # OpenAI's values


def _integer(name: str, value: Any, high: int, param: str = HYPERPARAMETERS_PARAM) -> int:
    if type(value) is not int or not 1 <= value <= high:
        raise SettingsError(f"{param}.{name}", f"{name} must be an integer in 1..{high}, got {value!r}")
    return value


@dataclass(frozen=True, slots=True)
class ReinforcementRequest:
    """`method.reinforcement` (module docstring); None fields: "auto" (or not given).

    Raises:
        SettingsError: a bad grader (param `method.reinforcement.grader...`) or a value out of range
            (param `method.reinforcement.hyperparameters.<name>`).
    """

    grader: Mapping[str, Any]  # OpenAI's grader JSON, as given
    compute_multiplier: float | None = None
    eval_interval: int | None = None
    eval_samples: int | None = None
    reasoning_effort: str | None = None
    max_completion_tokens: int | None = None

    def __post_init__(self) -> None:
        self.parsed_grader()
        cm = self.compute_multiplier
        if cm is not None:
            if isinstance(cm, bool) or not isinstance(cm, int | float) or not math.isfinite(cm) \
                    or not MIN_SAMPLES <= round(BASE_SAMPLES * cm) <= MAX_SAMPLES:
                raise SettingsError(f"{HYPERPARAMETERS_PARAM}.compute_multiplier",
                                    f"compute_multiplier samples each prompt round({BASE_SAMPLES} x "
                                    f"compute_multiplier) times, {MIN_SAMPLES} to {MAX_SAMPLES} times: give "
                                    f"0.5 to 8, got {cm!r}")
            object.__setattr__(self, "compute_multiplier", float(cm))
        if self.eval_interval is not None:
            _integer("eval_interval", self.eval_interval, MAX_EVAL_INTERVAL)
        if self.eval_samples is not None:
            _integer("eval_samples", self.eval_samples, MAX_EVAL_SAMPLES)
        if self.max_completion_tokens is not None:
            _integer("max_completion_tokens", self.max_completion_tokens, MAX_COMPLETION_TOKENS, PARAM)
        effort = self.reasoning_effort
        if effort is not None and effort != "default":
            known = effort in REASONING_EFFORTS
            raise SettingsError(f"{HYPERPARAMETERS_PARAM}.reasoning_effort",
                                f"reasoning_effort {effort!r} " + ("cannot be honoured: the models coserve "
                                                                   "serves have no reasoning mode; use "
                                                                   "'default'" if known else
                                                                   f"is not one of {list(REASONING_EFFORTS)}"))

    def parsed_grader(self) -> Grader:
        return parse_grader(self.grader, f"{PARAM}.grader")

    @property
    def samples(self) -> int:
        """Completions per prompt (GRPO's group)."""
        return round(BASE_SAMPLES * (1.0 if self.compute_multiplier is None else self.compute_multiplier))

    @property
    def completion_tokens(self) -> int:
        return self.max_completion_tokens or DEFAULT_MAX_COMPLETION_TOKENS

    def resolved_eval_interval(self, total_steps: int) -> int:
        if self.eval_interval is not None:
            return self.eval_interval
        return max(1, -(-total_steps // EVALUATIONS_PER_JOB))

    def hyperparameters_json(self) -> dict[str, Any]:
        """The hyperparameters beyond the supervised ones, as OpenAI's JSON ("auto" for None)."""
        return {"compute_multiplier": _auto(self.compute_multiplier), "eval_interval": _auto(self.eval_interval),
                "eval_samples": _auto(self.eval_samples), "reasoning_effort": self.reasoning_effort or "default"}

    def to_dict(self) -> dict[str, Any]:
        """What the job row keeps (`from_dict` reads it back)."""
        out: dict[str, Any] = {"grader": dict(self.grader), **self.hyperparameters_json()}
        if self.max_completion_tokens is not None:
            out["max_completion_tokens"] = self.max_completion_tokens
        return out

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> ReinforcementRequest:
        """From `to_dict`'s JSON ("auto" or absent is None).

        Raises:
            SettingsError: no grader, or what `__post_init__` refuses.
        """
        if not isinstance(raw.get("grader"), Mapping):
            raise SettingsError(f"{PARAM}.grader", "a reinforcement job needs a grader")
        values = {k: None if raw.get(k) in ("auto", None) else raw[k]
                  for k in ("compute_multiplier", "eval_interval", "eval_samples", "max_completion_tokens")}
        effort = raw.get("reasoning_effort")
        return cls(grader=raw["grader"], reasoning_effort=None if effort in (None, "default") else effort,
                   **values)


def _auto(value: Any) -> Any:
    return "auto" if value is None else value


@dataclass(frozen=True, slots=True)
class RolloutSpec:
    """What a reinforcement job's rollout loop needs beside its `FinetuneJobSpec` (whose examples are the
    training prompts): the grader, each prompt's row (what `{{ item.* }}` reads), the group size, the
    longest completion, and the validation prompts with their rows and evaluation settings."""

    grader: Grader
    items: list[dict[str, Any]]  # one per training prompt
    samples: int
    max_tokens: int
    eval_prompts: list[list[int]] = field(default_factory=list)
    eval_items: list[dict[str, Any]] = field(default_factory=list)
    eval_interval: int = 1
    eval_samples: int = 1

    def __post_init__(self) -> None:
        if not MIN_SAMPLES <= self.samples <= MAX_SAMPLES or self.max_tokens < 1:
            raise ValueError(f"a group needs {MIN_SAMPLES}..{MAX_SAMPLES} samples and a completion >= 1 "
                             f"token, got {self.samples} and {self.max_tokens}")
        if len(self.eval_prompts) != len(self.eval_items) or self.eval_interval < 1 or self.eval_samples < 1:
            raise ValueError("one row per validation prompt; eval_interval and eval_samples >= 1")


@dataclass(frozen=True, slots=True)
class GradedSample:
    """One completion's grade: its reward, the sub-graders' rewards, and why it scored 0 when it failed."""

    reward: float
    sub_rewards: dict[str, float] = field(default_factory=dict)
    error: str | None = None


class RolloutGrading(Protocol):
    """Grades a job's completions off the caller's thread (a model call, a python child process)."""

    def grade(self, tenant: str, grader: Grader, items: Sequence[Mapping[str, Any]],
              completions: Sequence[Sequence[int]]) -> Future[list[GradedSample]]:
        """Completion i (token ids) graded for row `items[i]`, model graders' judgements asked as `tenant`;
        the future never raises (a failed sample is a `GradedSample` with its `error`)."""
        ...
