"""OpenAI's graders as typed values: what a reinforcement job and `/v1/fine_tuning/alpha/graders/*` take.

`parse_grader` reads OpenAI's JSON (`openai/types/graders/`) once, at the gateway, and raises
`SettingsError` naming the offending field by its path (`grader.graders.a.operation`). The types:

- `StringCheckGrader`: `eq`, `ne`, `like` (the reference is contained), `ilike` (the same, ignoring case);
- `TextSimilarityGrader`: one of OpenAI's metrics (`SimilarityMetric`);
- `MultiGrader`: a formula (`calculate_output`) over named sub-graders;
- `PythonGrader`, `ScoreModelGrader`, `LabelModelGrader`: parsed, so that a server which cannot run one
  refuses it by name (`coserve.graders.checks.check_grader`).

Templates (`{{ item.answer }}`, `{{ sample.output_text }}`) stay text here; `coserve.graders.templates`
checks and renders them.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from coserve.contract.training_settings import SettingsError

MAX_GRADER_DEPTH = 4  # a multi grader inside a multi grader ...: OpenAI nests them one level; this is generous
MAX_SUB_GRADERS = 32
MAX_TEXT_CHARS = 65_536  # a template, a reference, a formula or a python grader's source
DEFAULT_JUDGE_TOKENS = 64  # a model grader's reply: {"result": ...} (its `max_completions_tokens`)
MAX_JUDGE_TOKENS = 4096


class StringOperation(str, enum.Enum):
    EQ = "eq"
    NE = "ne"
    LIKE = "like"
    ILIKE = "ilike"


class SimilarityMetric(str, enum.Enum):
    COSINE = "cosine"
    FUZZY_MATCH = "fuzzy_match"
    BLEU = "bleu"
    GLEU = "gleu"
    METEOR = "meteor"
    ROUGE_1 = "rouge_1"
    ROUGE_2 = "rouge_2"
    ROUGE_3 = "rouge_3"
    ROUGE_4 = "rouge_4"
    ROUGE_5 = "rouge_5"
    ROUGE_L = "rouge_l"


@dataclass(frozen=True, slots=True)
class StringCheckGrader:
    name: str
    input: str
    reference: str
    operation: StringOperation


@dataclass(frozen=True, slots=True)
class TextSimilarityGrader:
    name: str
    input: str
    reference: str
    metric: SimilarityMetric


@dataclass(frozen=True, slots=True)
class PythonGrader:
    name: str
    source: str


@dataclass(frozen=True, slots=True)
class JudgeSampling:
    """A model grader's `sampling_params` (None: the served model's defaults; greedy when temperature 0)."""

    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    max_completion_tokens: int = DEFAULT_JUDGE_TOKENS


@dataclass(frozen=True, slots=True)
class ModelGrader:
    """A `score_model` (`labels` empty) or `label_model` grader: judged by a served model."""

    name: str
    model: str
    messages: tuple[tuple[str, str], ...]  # (role, content template)
    labels: tuple[str, ...] = ()
    passing_labels: tuple[str, ...] = ()
    score_range: tuple[float, float] = (0.0, 1.0)
    sampling: JudgeSampling = JudgeSampling()

    @property
    def kind(self) -> str:
        return "label_model" if self.labels else "score_model"


@dataclass(frozen=True, slots=True)
class MultiGrader:
    name: str
    graders: tuple[tuple[str, Grader], ...]  # (the name the formula uses, the grader), in the given order
    calculate_output: str


Grader = StringCheckGrader | TextSimilarityGrader | PythonGrader | ModelGrader | MultiGrader


def grader_type(grader: Grader) -> str:
    """OpenAI's `type` of `grader`."""
    if isinstance(grader, ModelGrader):
        return grader.kind
    return _TYPE_NAMES[type(grader)]


def _text(raw: Mapping[str, Any], key: str, param: str, *, required: bool = True) -> str:
    value = raw.get(key)
    if value is None and not required:
        return ""
    if not isinstance(value, str):
        raise SettingsError(f"{param}.{key}", f"{param}.{key} must be a string, got {type(value).__name__}")
    if len(value) > MAX_TEXT_CHARS:
        raise SettingsError(f"{param}.{key}", f"{param}.{key} is {len(value)} characters; at most "
                            f"{MAX_TEXT_CHARS} are accepted")
    return value


def _choice(raw: Mapping[str, Any], key: str, param: str, kind: type[enum.Enum]) -> Any:
    try:
        return kind(raw.get(key))
    except ValueError:
        allowed = ", ".join(repr(member.value) for member in kind)
        raise SettingsError(f"{param}.{key}", f"{param}.{key} must be one of {allowed}, got "
                            f"{raw.get(key)!r}") from None


def _strings(raw: Mapping[str, Any], key: str, param: str) -> tuple[str, ...]:
    values = raw.get(key, [])
    if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
        raise SettingsError(f"{param}.{key}", f"{param}.{key} must be a list of strings")
    return tuple(values)


def _messages(raw: Mapping[str, Any], param: str) -> tuple[tuple[str, str], ...]:
    messages = raw.get("input")
    if not isinstance(messages, list) or not messages:
        raise SettingsError(f"{param}.input", f"{param}.input must be a non-empty list of messages")
    out = []
    for i, message in enumerate(messages):
        where = f"{param}.input.{i}"
        if not isinstance(message, Mapping) or message.get("role") not in ("user", "assistant", "system",
                                                                              "developer"):
            raise SettingsError(f"{where}.role", f"{where} must be a message with a role of user, assistant, "
                                "system or developer")
        out.append((str(message["role"]), _text(message, "content", where)))
    return tuple(out)


def _range(raw: Mapping[str, Any], param: str) -> tuple[float, float]:
    value = raw.get("range", [0.0, 1.0])
    if not (isinstance(value, list) and len(value) == 2 and all(isinstance(v, int | float) and
                                                                not isinstance(v, bool) for v in value)
            and value[0] < value[1]):
        raise SettingsError(f"{param}.range", f"{param}.range must be two numbers, low < high")
    return float(value[0]), float(value[1])


def _number(raw: Mapping[str, Any], key: str, param: str, low: float, high: float) -> float | None:
    value = raw.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise SettingsError(f"{param}.{key}", f"{param}.{key} must be a number in [{low:g}, {high:g}], got "
                            f"{value!r}")
    return float(value)


def _judge_sampling(raw: Mapping[str, Any], param: str) -> JudgeSampling:
    sampling = raw.get("sampling_params") or {}
    where = f"{param}.sampling_params"
    if not isinstance(sampling, Mapping):
        raise SettingsError(where, f"{where} must be an object")
    unknown = set(sampling) - {"temperature", "top_p", "seed", "max_completions_tokens", "reasoning_effort"}
    if unknown or sampling.get("reasoning_effort") is not None:
        name = sorted(unknown)[0] if unknown else "reasoning_effort"
        raise SettingsError(f"{where}.{name}", f"{where}.{name} is not supported: coserve's judges are "
                            "not reasoning models; give temperature, top_p, seed or max_completions_tokens")
    seed, tokens = sampling.get("seed"), sampling.get("max_completions_tokens", DEFAULT_JUDGE_TOKENS)
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise SettingsError(f"{where}.seed", f"{where}.seed must be an integer")
    if isinstance(tokens, bool) or not isinstance(tokens, int) or not 1 <= tokens <= MAX_JUDGE_TOKENS:
        raise SettingsError(f"{where}.max_completions_tokens", f"{where}.max_completions_tokens must be an "
                            f"integer in [1, {MAX_JUDGE_TOKENS}]")
    return JudgeSampling(_number(sampling, "temperature", where, 0.0, 2.0),
                         _number(sampling, "top_p", where, 0.0, 1.0), seed, tokens)


def _model_grader(raw: Mapping[str, Any], param: str, name: str, labelled: bool) -> ModelGrader:
    model, messages, sampling = _text(raw, "model", param), _messages(raw, param), _judge_sampling(raw, param)
    if labelled:
        labels, passing = _strings(raw, "labels", param), _strings(raw, "passing_labels", param)
        if not labels or not set(passing) <= set(labels) or not passing:
            raise SettingsError(f"{param}.passing_labels", f"{param} needs labels, and passing_labels "
                                "that are some of them")
        return ModelGrader(name, model, messages, labels, passing, sampling=sampling)
    return ModelGrader(name, model, messages, score_range=_range(raw, param), sampling=sampling)


def _multi(raw: Mapping[str, Any], param: str, name: str, depth: int) -> MultiGrader:
    subs = raw.get("graders")
    if isinstance(subs, Mapping) and "type" in subs and isinstance(subs.get("type"), str):
        subs = {str(subs.get("name", "")): subs}  # one grader object (the SDK's type allows it)
    if not isinstance(subs, Mapping) or not subs or len(subs) > MAX_SUB_GRADERS:
        raise SettingsError(f"{param}.graders", f"{param}.graders must map 1 to {MAX_SUB_GRADERS} names to "
                            "graders")
    graders = tuple((str(key), parse_grader(value, f"{param}.graders.{key}", depth + 1))
                    for key, value in subs.items())
    return MultiGrader(name, graders, _text(raw, "calculate_output", param))


def parse_grader(raw: Any, param: str = "grader", depth: int = 0) -> Grader:
    """The grader that OpenAI's JSON `raw` describes.

    Raises:
        SettingsError: a missing or malformed field, an unknown type, or nesting deeper than
            `MAX_GRADER_DEPTH`; `param` is the field's path.
    """
    if depth > MAX_GRADER_DEPTH:
        raise SettingsError(param, f"graders nest at most {MAX_GRADER_DEPTH} deep")
    if not isinstance(raw, Mapping):
        raise SettingsError(param, f"{param} must be a grader object")
    kind, name = raw.get("type"), _text(raw, "name", param)
    if kind == "string_check":
        return StringCheckGrader(name, _text(raw, "input", param), _text(raw, "reference", param),
                                 _choice(raw, "operation", param, StringOperation))
    if kind == "text_similarity":
        return TextSimilarityGrader(name, _text(raw, "input", param), _text(raw, "reference", param),
                                    _choice(raw, "evaluation_metric", param, SimilarityMetric))
    if kind == "python":
        return PythonGrader(name, _text(raw, "source", param))
    if kind in ("score_model", "label_model"):
        return _model_grader(raw, param, name, kind == "label_model")
    if kind == "multi":
        return _multi(raw, param, name, depth)
    raise SettingsError(f"{param}.type", f"{param}.type must be one of 'string_check', 'text_similarity', "
                        f"'score_model', 'label_model', 'python', 'multi', got {kind!r}")


_TYPE_NAMES: dict[type, str] = {StringCheckGrader: "string_check", TextSimilarityGrader: "text_similarity",
                                PythonGrader: "python", MultiGrader: "multi"}


# The keys of each grader type in OpenAI's JSON (`openai/types/graders/*_param.py`); coserve reads some and
# accepts the rest unused (a python grader's `image_tag`). Model graders take `sampling_params` (its own
# keys: `_judge_sampling`).
GRADER_KEYS: dict[str, frozenset[str]] = {
    "string_check": frozenset({"type", "name", "input", "reference", "operation"}),
    "text_similarity": frozenset({"type", "name", "input", "reference", "evaluation_metric"}),
    "python": frozenset({"type", "name", "source", "image_tag"}),
    "score_model": frozenset({"type", "name", "model", "input", "range", "sampling_params"}),
    "label_model": frozenset({"type", "name", "model", "input", "labels", "passing_labels", "sampling_params"}),
    "multi": frozenset({"type", "name", "graders", "calculate_output"}),
}
_JUDGE_MESSAGE_KEYS = frozenset({"type", "role", "content"})


def unknown_grader_key(raw: Any, depth: int = 0) -> list[int | str] | None:
    """The path inside `raw` (`['graders', 'a', 'refrence']`) of the first key its grader type does not
    have; None when there is none, or when `raw` is not a grader of a known type (`parse_grader` says
    what is wrong with it)."""
    if depth > MAX_GRADER_DEPTH or not isinstance(raw, Mapping) or not isinstance(raw.get("type"), str):
        return None
    keys = GRADER_KEYS.get(raw["type"])
    if keys is None:
        return None
    for key in raw:
        if key not in keys:
            return [key]
    messages = raw.get("input") if raw["type"] in ("score_model", "label_model") else None
    for index, message in enumerate(messages if isinstance(messages, list) else []):
        unknown = [key for key in message if key not in _JUDGE_MESSAGE_KEYS] if isinstance(message, Mapping) else []
        if unknown:
            return ["input", index, unknown[0]]
    subs = raw.get("graders") if raw["type"] == "multi" else None
    if not isinstance(subs, Mapping):
        return None
    if isinstance(subs.get("type"), str):  # one grader object, as `_multi` reads it
        inner = unknown_grader_key(subs, depth + 1)
        return None if inner is None else ["graders", *inner]
    for name, sub in subs.items():
        inner = unknown_grader_key(sub, depth + 1)
        if inner is not None:
            return ["graders", name, *inner]
    return None
