"""Running a grader on one sample (`grade`): the reward in [0, 1] (a multi grader's formula may leave it),
the sub-graders' rewards, and OpenAI's error flags instead of exceptions, so that one bad sample is a
score of 0 with a reason, never a failed request or a failed job step."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from coserve.contract.grader import (
    Grader,
    MultiGrader,
    PythonGrader,
    StringCheckGrader,
    StringOperation,
    TextSimilarityGrader,
)
from coserve.graders.formula import FormulaError, evaluate
from coserve.graders.python_grader import PythonGraderRunner, PythonOutcome
from coserve.graders.similarity import similarity
from coserve.graders.templates import Sample, SampleParseError, VariableError, render

MAX_SIMILARITY_CHARS = 10_000  # each text a similarity metric compares (ROUGE-L is quadratic in words)


class TextTooLong(ValueError):
    """A rendered text is over `MAX_SIMILARITY_CHARS` (reward 0, `other_error`)."""


@dataclass(slots=True)
class GradeErrors:
    """OpenAI's `metadata.errors` flags that an in-process grader can raise."""

    formula_parse_error: bool = False
    invalid_variable_error: bool = False
    sample_parse_error: bool = False
    other_error: bool = False
    python_grader_runtime_error: bool = False
    python_grader_server_error: bool = False
    python_grader_server_error_type: str | None = None
    details: list[str] = field(default_factory=list)

    @property
    def any(self) -> bool:
        return self.formula_parse_error or self.invalid_variable_error or self.sample_parse_error or \
            self.other_error or self.python_grader_runtime_error or self.python_grader_server_error


class PythonGraderFailed(RuntimeError):
    """A python grader gave no reward (`outcome` says why)."""

    def __init__(self, outcome: PythonOutcome) -> None:
        super().__init__(outcome.details or "the python grader gave no reward")
        self.outcome = outcome


@dataclass(slots=True)
class Grade:
    reward: float
    sub_rewards: dict[str, float]
    errors: GradeErrors
    execution_time: float


def _string_check(grader: StringCheckGrader, item: Mapping[str, Any], sample: Sample) -> float:
    text, reference = render(grader.input, item, sample), render(grader.reference, item, sample)
    if grader.operation == StringOperation.EQ:
        return float(text == reference)
    if grader.operation == StringOperation.NE:
        return float(text != reference)
    if grader.operation == StringOperation.LIKE:
        return float(reference in text)
    return float(reference.lower() in text.lower())


def _python(grader: PythonGrader, item: Mapping[str, Any], sample: Sample,
            runner: PythonGraderRunner | None, wait: bool) -> float:
    if runner is None:  # checks.check_grader refused it
        raise RuntimeError("python graders are off on this server")
    try:
        output_json = sample.output_json
    except SampleParseError:
        output_json = None
    outcome = runner.run(grader.source, {"output_text": sample.output_text, "output_json": output_json},
                         dict(item), wait=wait)
    if outcome.reward is None:
        raise PythonGraderFailed(outcome)
    return outcome.reward


def _score(grader: Grader, item: Mapping[str, Any], sample: Sample, subs: dict[str, float],
           runner: PythonGraderRunner | None, wait: bool) -> float:
    if isinstance(grader, PythonGrader):
        return _python(grader, item, sample, runner, wait)
    if isinstance(grader, StringCheckGrader):
        return _string_check(grader, item, sample)
    if isinstance(grader, TextSimilarityGrader):
        text, reference = render(grader.input, item, sample), render(grader.reference, item, sample)
        if max(len(text), len(reference)) > MAX_SIMILARITY_CHARS:
            raise TextTooLong(f"text_similarity compares texts of at most {MAX_SIMILARITY_CHARS} characters; "
                              f"got {len(text)} and {len(reference)}")
        return similarity(grader.metric, text, reference)
    assert isinstance(grader, MultiGrader)  # checks.check_grader refused the model graders
    scores = {name: _score(sub, item, sample, {}, runner, wait) for name, sub in grader.graders}
    subs.update(scores)
    return evaluate(grader.calculate_output, scores)


def grade(grader: Grader, item: Mapping[str, Any], model_sample: str,
          python: PythonGraderRunner | None = None, *, wait: bool = True) -> Grade:
    """Grade `model_sample` for the dataset row `item` (checked with `checks.check_grader` first);
    `python` runs python graders (`wait=False`: `GradersBusy` rather than wait for a free slot)."""
    start, errors, reward = time.perf_counter(), GradeErrors(), 0.0
    subs: dict[str, float] = {}
    try:
        reward = _score(grader, item, Sample(model_sample), subs, python, wait)
    except VariableError as err:
        errors.invalid_variable_error = True
        errors.details.append(str(err))
    except SampleParseError as err:
        errors.sample_parse_error = True
        errors.details.append(str(err))
    except FormulaError as err:
        errors.formula_parse_error = True
        errors.details.append(str(err))
    except TextTooLong as err:
        errors.other_error = True
        errors.details.append(str(err))
    except PythonGraderFailed as err:
        outcome = err.outcome
        errors.python_grader_runtime_error, errors.python_grader_server_error = \
            outcome.runtime_error, outcome.server_error
        errors.python_grader_server_error_type = outcome.error_type
        errors.details.append(str(err))
    return Grade(reward, subs, errors, time.perf_counter() - start)
