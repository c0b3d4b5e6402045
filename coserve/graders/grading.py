"""Running a grader on one sample (`grade`): the reward in [0, 1] (a multi grader's formula may leave it),
the sub-graders' rewards, and OpenAI's error flags instead of exceptions, so that one bad sample is a
score of 0 with a reason, never a failed request or a failed job step.

One sample's similarity work is bounded, whatever the grader's shape (`checks.check_work` bounds how many
graders score): each text at most `MAX_SIMILARITY_CHARS`, the texts compared by all its `text_similarity`
graders together at most `MAX_GRADING_CHARS`, and ROUGE-L's longest common subsequence, quadratic in words,
at most `MAX_LCS_WORD_PAIRS` (the words of the input times those of the reference, as rouge-score tokenizes
them, summed over its `rouge_l` graders). A sample over a bound scores 0 with `other_error`, before the
metric runs."""

from __future__ import annotations

import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from coserve.contract.grader import (
    Grader,
    ModelGrader,
    MultiGrader,
    PythonGrader,
    SimilarityMetric,
    StringCheckGrader,
    StringOperation,
    TextSimilarityGrader,
)
from coserve.graders.fair_slots import Lease
from coserve.graders.formula import FormulaError, evaluate
from coserve.graders.judging import Judgement
from coserve.graders.python_grader import PythonGraderRunner, PythonOutcome
from coserve.graders.similarity import similarity
from coserve.graders.templates import Sample, SampleParseError, VariableError, render

MAX_SIMILARITY_CHARS = 10_000  # each text a similarity metric compares (ROUGE-L is quadratic in words)
MAX_GRADING_CHARS = 100_000  # all the texts one sample's similarity graders compare, together
MAX_LCS_WORD_PAIRS = 1_000_000  # ROUGE-L: words x reference words, over one sample's rouge_l graders (~1 s)
_ROUGE_WORD = re.compile(r"[a-z0-9]+")  # rouge-score's tokens: lower-cased runs of ASCII letters and digits


class TextTooLong(ValueError):
    """A rendered text, or one sample's similarity work, is over its bound (reward 0, `other_error`)."""


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
    model_grader_parse_error: bool = False
    model_grader_server_error: bool = False
    details: list[str] = field(default_factory=list)

    @property
    def any(self) -> bool:
        return self.formula_parse_error or self.invalid_variable_error or self.sample_parse_error or \
            self.other_error or self.python_grader_runtime_error or self.python_grader_server_error or \
            self.model_grader_parse_error or self.model_grader_server_error


class PythonGraderFailed(RuntimeError):
    """A python grader gave no reward (`outcome` says why)."""

    def __init__(self, outcome: PythonOutcome) -> None:
        super().__init__(outcome.details or "the python grader gave no reward")
        self.outcome = outcome


class ModelGraderFailed(RuntimeError):
    """A model grader gave no reward (`judgement` says why)."""

    def __init__(self, grader: ModelGrader, judgement: Judgement) -> None:
        why = judgement.server_error or f"the judge's reply was not {{\"result\": ...}} as {grader.kind} asks"
        super().__init__(f"{grader.name}: {why}")
        self.judgement = judgement


@dataclass(slots=True)
class Grade:
    reward: float
    sub_rewards: dict[str, float]
    errors: GradeErrors
    execution_time: float


@dataclass(slots=True)
class _Context:
    """What grading one sample reads: the row, the sample, and how to run python and model graders."""

    item: Mapping[str, Any]
    sample: Sample
    python: PythonGraderRunner | None
    tenant: str
    lease: Lease | None  # a python grader slot the caller holds; None: each python grader takes one
    judged: Mapping[int, Judgement]  # id(model grader) -> its verdict, from the gateway's judge
    chars_left: int = MAX_GRADING_CHARS
    pairs_left: int = MAX_LCS_WORD_PAIRS


def _string_check(grader: StringCheckGrader, item: Mapping[str, Any], sample: Sample) -> float:
    text, reference = render(grader.input, item, sample), render(grader.reference, item, sample)
    if grader.operation == StringOperation.EQ:
        return float(text == reference)
    if grader.operation == StringOperation.NE:
        return float(text != reference)
    if grader.operation == StringOperation.LIKE:
        return float(reference in text)
    return float(reference.lower() in text.lower())


def _python(grader: PythonGrader, ctx: _Context) -> float:
    if ctx.python is None:  # checks.check_grader refused it
        raise RuntimeError("python graders are off on this server")
    try:
        output_json = ctx.sample.output_json
    except SampleParseError:
        output_json = None
    outcome = ctx.python.run(grader.source, {"output_text": ctx.sample.output_text, "output_json": output_json},
                             dict(ctx.item), tenant=ctx.tenant, lease=ctx.lease)
    if outcome.reward is None:
        raise PythonGraderFailed(outcome)
    return outcome.reward


def _judged(grader: ModelGrader, ctx: _Context) -> float:
    for _, content in grader.messages:  # a variable the row lacks is flagged as in any grader
        render(content, ctx.item, ctx.sample)
    judgement = ctx.judged.get(id(grader))
    if judgement is None:  # checks.check_grader refused it where nobody judges
        raise RuntimeError(f"{grader.name}: no judgement")
    if judgement.reward is None:
        raise ModelGraderFailed(grader, judgement)
    return judgement.reward


def _score(grader: Grader, ctx: _Context, subs: dict[str, float]) -> float:
    item, sample = ctx.item, ctx.sample
    if isinstance(grader, PythonGrader):
        return _python(grader, ctx)
    if isinstance(grader, ModelGrader):
        return _judged(grader, ctx)
    if isinstance(grader, StringCheckGrader):
        return _string_check(grader, item, sample)
    if isinstance(grader, TextSimilarityGrader):
        text, reference = render(grader.input, item, sample), render(grader.reference, item, sample)
        _spend(grader, text, reference, ctx)
        return similarity(grader.metric, text, reference)
    assert isinstance(grader, MultiGrader)
    scores = {name: _score(sub, ctx, {}) for name, sub in grader.graders}
    subs.update(scores)
    return evaluate(grader.calculate_output, scores)


def _spend(grader: TextSimilarityGrader, text: str, reference: str, ctx: _Context) -> None:
    """Charge one comparison to the sample's budget (module docstring); TextTooLong past a bound."""
    if max(len(text), len(reference)) > MAX_SIMILARITY_CHARS:
        raise TextTooLong(f"text_similarity compares texts of at most {MAX_SIMILARITY_CHARS} characters; "
                          f"got {len(text)} and {len(reference)}")
    ctx.chars_left -= len(text) + len(reference)
    if ctx.chars_left < 0:
        raise TextTooLong(f"this sample's text_similarity graders compare more than {MAX_GRADING_CHARS} "
                          "characters together")
    if grader.metric == SimilarityMetric.ROUGE_L:
        ctx.pairs_left -= len(_ROUGE_WORD.findall(text.lower())) * len(_ROUGE_WORD.findall(reference.lower()))
        if ctx.pairs_left < 0:
            raise TextTooLong(f"this sample's rouge_l graders compare more than {MAX_LCS_WORD_PAIRS} pairs of "
                              "words (the words of the input times those of the reference)")


def _flag(errors: GradeErrors, err: Exception) -> None:
    """Set OpenAI's flag for why the sample scored 0, and keep the reason."""
    errors.details.append(str(err))
    if isinstance(err, VariableError):
        errors.invalid_variable_error = True
    elif isinstance(err, SampleParseError):
        errors.sample_parse_error = True
    elif isinstance(err, FormulaError):
        errors.formula_parse_error = True
    elif isinstance(err, TextTooLong):
        errors.other_error = True
    elif isinstance(err, ModelGraderFailed):
        errors.model_grader_parse_error = err.judgement.parse_error
        errors.model_grader_server_error = err.judgement.server_error is not None
    elif isinstance(err, PythonGraderFailed):
        errors.python_grader_runtime_error = err.outcome.runtime_error
        errors.python_grader_server_error = err.outcome.server_error
        errors.python_grader_server_error_type = err.outcome.error_type


def grade(grader: Grader, item: Mapping[str, Any], model_sample: str,
          python: PythonGraderRunner | None = None, *, tenant: str = "", lease: Lease | None = None,
          judged: Mapping[int, Judgement] | None = None) -> Grade:
    """Grade `model_sample` for the dataset row `item` (checked with `checks.check_grader` first) for
    `tenant`; `python` runs python graders, in `lease` (a slot the caller holds) or each in a slot it waits
    for (`python.slots`, fair between tenants); `judged` holds the verdicts of the grader's model graders
    (by `id`), asked beforehand."""
    start, errors, reward = time.perf_counter(), GradeErrors(), 0.0
    subs: dict[str, float] = {}
    judged = judged or {}
    try:
        reward = _score(grader, _Context(item, Sample(model_sample), python, tenant, lease, judged), subs)
    except (VariableError, SampleParseError, FormulaError, TextTooLong, ModelGraderFailed,
            PythonGraderFailed) as err:
        _flag(errors, err)
    return Grade(reward, subs, errors, time.perf_counter() - start)
