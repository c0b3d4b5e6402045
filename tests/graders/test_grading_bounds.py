"""Bounded grading work: formulas computed in floats under a clock and a nesting bound, how many graders one
grader holds, and one sample's similarity work; each past its bound an error flag or a `SettingsError`
naming the field, never a long computation or an exception."""

from __future__ import annotations

import time
from typing import Any

import pytest

from coserve.contract.grader import parse_grader
from coserve.contract.training_settings import SettingsError
from coserve.graders.checks import MAX_LEAF_GRADERS, MAX_PYTHON_GRADERS, check_grader
from coserve.graders.formula import MAX_FORMULA_DEPTH, FormulaError, check_formula, evaluate
from coserve.graders.grading import MAX_GRADING_CHARS, MAX_LCS_WORD_PAIRS, grade

EXACT = {"type": "string_check", "name": "exact", "input": "{{ sample.output_text }}",
         "reference": "{{ item.answer }}", "operation": "eq"}


def similar(metric: str, reference: str = "{{ item.answer }}") -> dict[str, Any]:
    return {"type": "text_similarity", "name": metric, "input": "{{ sample.output_text }}",
            "reference": reference, "evaluation_metric": metric}


@pytest.mark.parametrize("formula", ["4000000^1000000", "1000^1000", "exp(1000)", "a * 1e308 * 10",
                                     "(0 - 8) ^ (1 / 3)", "floor(1e308) * 1e10"])
def test_big_powers_and_overflows_have_no_value_at_once(formula: str) -> None:
    start = time.perf_counter()
    with pytest.raises(FormulaError):
        evaluate(formula, {"a": 0.5})
    assert time.perf_counter() - start < 0.05  # 4000000^1000000 as Python integers: 5-6 s holding the GIL
    check_formula(formula, ["a"], "p")  # it parses: an error per sample, not a refused grader


def test_a_grader_with_a_big_power_scores_zero_with_a_flag() -> None:
    grader = parse_grader({"type": "multi", "name": "m", "calculate_output": "1000 ^ 1000 * exact",
                           "graders": {"exact": EXACT}})
    result = grade(grader, {"answer": "x"}, "x")
    assert result.reward == 0.0 and result.errors.formula_parse_error and "range" in result.errors.details[0]


def test_every_operation_is_a_float_operation() -> None:
    assert evaluate("2 ^ 10", {}) == 1024.0 and evaluate("2 ^ 0.5 ^ 2", {}) == pytest.approx(2 ** 0.25)
    assert evaluate("0.25 * a + 0.75 * b", {"a": 1.0, "b": 0.0}) == 0.25
    assert evaluate("floor(a * 10) / 10", {"a": 0.57}) == 0.5


@pytest.mark.parametrize(("formula", "words"), [
    ("9" * 400, "not a number a float can hold"),
    ("1e999", "not a number a float can hold"),
    ("+".join(["a"] * (MAX_FORMULA_DEPTH + 2)), "nests"),
])
def test_formulas_that_can_never_have_a_value_are_refused(formula: str, words: str) -> None:
    with pytest.raises(SettingsError, match=words) as info:
        check_formula(formula, ["a"], "grader.calculate_output")
    assert info.value.param == "grader.calculate_output"


def test_the_longest_formula_takes_milliseconds() -> None:
    formula = "a"
    while len(formula) * 2 + 3 < 4096:
        formula = f"({formula}*{formula})" if len(formula) < 1000 else f"({formula}+{formula})"
    check_formula(formula, ["a"], "p")
    start = time.perf_counter()
    evaluate(formula, {"a": 0.9})
    assert time.perf_counter() - start < 0.2


def _nested(width: int, depth: int, leaf: dict[str, Any]) -> dict[str, Any]:
    if depth == 0:
        return leaf
    graders = {f"g{i}": _nested(width, depth - 1, leaf) for i in range(width)}
    return {"type": "multi", "name": "m", "calculate_output": "+".join(graders), "graders": graders}


def test_a_grader_holds_a_bounded_number_of_graders_that_score() -> None:
    check_grader(parse_grader(_nested(8, 2, EXACT)))  # 64
    with pytest.raises(SettingsError, match=f"at most {MAX_LEAF_GRADERS}") as info:
        check_grader(parse_grader(_nested(32, 3, similar("rouge_l"))))  # 32768 rouge_l graders
    assert info.value.param == "grader"
    python = {"type": "python", "name": "p", "source": "def grade(s, i):\n    return 1.0\n"}
    with pytest.raises(SettingsError, match=f"at most {MAX_PYTHON_GRADERS}"):
        check_grader(parse_grader(_nested(MAX_PYTHON_GRADERS + 1, 1, python)), python=True)


def test_one_samples_similarity_work_is_bounded() -> None:
    text = "word " * 1999  # 9,995 characters, 1,999 words: one rouge_l over it alone is ~4 s
    started = time.perf_counter()
    result = grade(parse_grader(similar("rouge_l", reference=text)), {}, text)
    assert result.reward == 0.0 and result.errors.other_error
    assert str(MAX_LCS_WORD_PAIRS) in result.errors.details[0] and time.perf_counter() - started < 0.5
    punctuated = "a," * 4999  # rouge-score reads 4,999 words in 9,998 characters with no space
    assert grade(parse_grader(similar("rouge_l", reference="b")), {}, punctuated).errors.other_error is False
    assert grade(parse_grader(similar("rouge_l", reference=punctuated)), {}, punctuated).errors.other_error
    many = _nested(11, 1, similar("rouge_1", reference=text))  # 11 x 2 x 9,995 characters
    result = grade(parse_grader(many), {}, text)
    assert result.errors.other_error and str(MAX_GRADING_CHARS) in result.errors.details[0]
    fits = _nested(4, 1, similar("rouge_1", reference=text))
    assert grade(parse_grader(fits), {}, text).reward == pytest.approx(4.0)
