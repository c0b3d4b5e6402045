"""OpenAI's graders in-process: parsing (errors name the field's path), templates, string checks, text
similarity on known values, multi-grader formulas, what this server refuses, and errors as flags."""

from __future__ import annotations

from typing import Any

import pytest

from coserve.contract.grader import MultiGrader, SimilarityMetric, StringCheckGrader, parse_grader
from coserve.contract.training_settings import SettingsError
from coserve.graders.checks import check_grader
from coserve.graders.formula import evaluate
from coserve.graders.grading import grade
from coserve.graders.similarity import similarity
from coserve.graders.templates import Sample, render


def _check(operation: str, reference: str = "{{ item.answer }}") -> dict[str, Any]:
    return {"type": "string_check", "name": "check", "input": "{{ sample.output_text }}",
            "reference": reference, "operation": operation}


@pytest.mark.parametrize(("operation", "sample", "reward"), [
    ("eq", "Paris", 1.0), ("eq", "paris", 0.0), ("ne", "paris", 1.0), ("ne", "Paris", 0.0),
    ("like", "It is Paris.", 1.0), ("like", "It is paris.", 0.0), ("ilike", "IT IS PARIS", 1.0),
    ("ilike", "Lyon", 0.0)])
def test_string_check_operations(operation: str, sample: str, reward: float) -> None:
    grader = parse_grader(_check(operation))
    check_grader(grader)
    assert grade(grader, {"answer": "Paris"}, sample).reward == reward


def test_templates_read_nested_fields_lists_and_the_sample_as_json() -> None:
    item = {"a": {"b": [3, {"c": "x"}]}, "flag": True}
    sample = Sample('{"city": "Paris", "n": [1, 2]}')
    assert render("{{item.a.b[0]}}|{{ item.a.b[1] }}|{{item.flag}}", item, sample) == '3|{"c": "x"}|true'
    assert render("{{ sample.output_json.city }}-{{sample.output_json.n[1]}}", item, sample) == "Paris-2"
    assert render("{{sample.output_text}}", item, sample) == sample.output_text


@pytest.mark.parametrize(("metric", "expected"), [
    # identical texts score 1 on every metric
    ("fuzzy_match", 1.0), ("bleu", 1.0), ("gleu", 1.0), ("rouge_1", 1.0), ("rouge_l", 1.0)])
def test_identical_texts_score_one(metric: str, expected: float) -> None:
    text = "the quick brown fox jumps over the lazy dog"
    assert similarity(SimilarityMetric(metric), text, text) == pytest.approx(expected)


def test_similarity_values_on_a_worked_example() -> None:
    text, reference = "the cat sat on the mat", "the cat is on the mat"
    # ROUGE-1: 5 of 6 unigrams shared both ways (F = 5/6); ROUGE-2: 3 of 5 bigrams (F = 0.6);
    # fuzzy_match ignores case and punctuation (RapidFuzz's default processing)
    assert similarity(SimilarityMetric.ROUGE_1, text, reference) == pytest.approx(5 / 6)
    assert similarity(SimilarityMetric.ROUGE_2, text, reference) == pytest.approx(0.6)
    assert similarity(SimilarityMetric.FUZZY_MATCH, "Hello World!", "hello world") == pytest.approx(1.0)
    assert 0.0 < similarity(SimilarityMetric.BLEU, text, reference) < 1.0
    assert similarity(SimilarityMetric.BLEU, "entirely different words", reference) < 0.1


def test_multi_grader_formula_with_openai_operators() -> None:
    raw = {"type": "multi", "name": "both", "calculate_output": "0.5 * exact + 0.5 * fuzzy ^ 2",
           "graders": {"exact": _check("eq"),
                       "fuzzy": {"type": "text_similarity", "name": "f", "input": "{{sample.output_text}}",
                                 "reference": "{{item.answer}}", "evaluation_metric": "fuzzy_match"}}}
    grader = parse_grader(raw)
    assert isinstance(grader, MultiGrader) and [n for n, _ in grader.graders] == ["exact", "fuzzy"]
    check_grader(grader)
    result = grade(grader, {"answer": "Paris"}, "paris")
    assert result.sub_rewards == {"exact": 0.0, "fuzzy": 1.0} and result.reward == pytest.approx(0.5)
    assert evaluate("-a ^ 2 + max(a, b) / 2 + floor(1.5) + sqrt(4) + log(1)", {"a": 2, "b": 4}) == \
        pytest.approx(-4 + 2 + 1 + 2 + 0)  # ^ binds tighter than * and unary minus, as in maths


@pytest.mark.parametrize(("raw", "param"), [
    ({"type": "string_check", "name": "x", "input": "a", "reference": "b", "operation": "regex"},
     "grader.operation"),
    ({"type": "string_check", "name": "x", "input": 3, "reference": "b", "operation": "eq"}, "grader.input"),
    ({"type": "nope", "name": "x"}, "grader.type"),
    ({"type": "text_similarity", "name": "x", "input": "a", "reference": "b", "evaluation_metric": "rouge_9"},
     "grader.evaluation_metric"),
    ({"type": "multi", "name": "m", "calculate_output": "a", "graders": {}}, "grader.graders"),
    ({"type": "multi", "name": "m", "calculate_output": "a", "graders": {"a": {"type": "string_check"}}},
     "grader.graders.a.name"),
    ({"type": "label_model", "name": "l", "model": "m", "input": [{"role": "user", "content": "x"}],
      "labels": ["a"], "passing_labels": ["b"]}, "grader.passing_labels"),
])
def test_malformed_graders_name_the_field(raw: dict[str, Any], param: str) -> None:
    with pytest.raises(SettingsError) as info:
        parse_grader(raw)
    assert info.value.param == param


@pytest.mark.parametrize(("raw", "param", "words"), [
    (_check("eq", "{{ answer }}"), "grader.reference", "not a template variable"),
    (_check("eq", "{{ model.answer }}"), "grader.reference", "namespace 'model'"),
    (_check("eq", "{{ sample.text }}"), "grader.reference", "output_text and output_json"),
    (_check("eq", "{{ item.answer"), "grader.reference", "not closed"),
    ({"type": "multi", "name": "m", "calculate_output": "a + c", "graders": {"a": _check("eq")}},
     "grader.calculate_output", "'c'"),
    ({"type": "multi", "name": "m", "calculate_output": "a.__class__", "graders": {"a": _check("eq")}},
     "grader.calculate_output", "only numbers"),
    ({"type": "multi", "name": "m", "calculate_output": "-" * 3000 + "a", "graders": {"a": _check("eq")}},
     "grader.calculate_output", "nests too deep"),
    ({"type": "multi", "name": "m", "calculate_output": "a + " * 2000 + "a", "graders": {"a": _check("eq")}},
     "grader.calculate_output", "at most 4096"),
    ({"type": "text_similarity", "name": "x", "input": "a", "reference": "b", "evaluation_metric": "cosine"},
     "grader.evaluation_metric", "embedding model"),
    ({"type": "python", "name": "p", "source": "def grade(sample, item): return 1"}, "grader.type", "python"),
    ({"type": "score_model", "name": "s", "model": "m", "input": [{"role": "user", "content": "x"}]},
     "grader.type", "score_model"),
])
def test_what_this_server_cannot_run_is_refused_before_running(raw: dict[str, Any], param: str,
                                                                words: str) -> None:
    with pytest.raises(SettingsError) as info:
        check_grader(parse_grader(raw))
    assert info.value.param == param and words in info.value.message


def test_errors_are_flags_with_a_zero_reward_not_exceptions() -> None:
    missing = grade(parse_grader(_check("eq")), {"question": "?"}, "Paris")
    assert missing.reward == 0.0 and missing.errors.invalid_variable_error
    not_json = grade(parse_grader(_check("eq", "{{ sample.output_json.city }}")), {}, "Paris")
    assert not_json.reward == 0.0 and not_json.errors.sample_parse_error
    divide = parse_grader({"type": "multi", "name": "m", "calculate_output": "1 / a",
                           "graders": {"a": _check("eq")}})
    check_grader(divide)  # 1 / a has a value for other scores
    result = grade(divide, {"answer": "x"}, "y")
    assert result.reward == 0.0 and result.errors.formula_parse_error
    rouge = parse_grader({"type": "text_similarity", "name": "r", "input": "{{ sample.output_text }}",
                          "reference": "{{ item.answer }}", "evaluation_metric": "rouge_l"})
    long = grade(rouge, {"answer": "word " * 3000}, "word " * 3000)  # 15,000 characters: over the bound
    assert long.reward == 0.0 and long.errors.other_error and "at most 10000" in long.errors.details[0]
    with pytest.raises(SettingsError, match="does not parse"):  # a NUL character: ast's ValueError
        check_grader(parse_grader({"type": "multi", "name": "m", "calculate_output": "a\x00",
                                   "graders": {"a": _check("eq")}}))
    huge = parse_grader({"type": "multi", "name": "m", "calculate_output": "2 ^ (1 + a * 1e7)",
                         "graders": {"a": _check("eq")}})
    check_grader(huge)  # bounded by simpleeval when it runs: a flag, not a hang or a 500
    assert grade(huge, {"answer": "x"}, "x").errors.formula_parse_error
    assert isinstance(parse_grader(_check("eq")), StringCheckGrader) and not grade(
        parse_grader(_check("eq")), {"answer": "x"}, "x").errors.any


def test_a_judges_reply_is_read_as_its_schema_says() -> None:
    from coserve.contract.grader import ModelGrader
    from coserve.graders.judging import judge_schema, read_judgement

    score = parse_grader({"type": "score_model", "name": "s", "model": "m", "range": [0, 10],
                          "input": [{"role": "user", "content": "{{ sample.output_text }}"}]})
    label = parse_grader({"type": "label_model", "name": "l", "model": "m", "labels": ["good", "bad"],
                          "passing_labels": ["good"], "input": [{"role": "user", "content": "x"}]})
    assert isinstance(score, ModelGrader) and isinstance(label, ModelGrader)
    assert judge_schema(label)["properties"]["result"] == {"type": "string", "enum": ["good", "bad"]}
    assert read_judgement(score, '{"result": "7.5"}', 12).reward == 7.5
    assert read_judgement(label, '{"result": "good"}', 3).reward == 1.0
    assert read_judgement(label, '{"result": "bad"}', 3).reward == 0.0
    for grader, reply in ((score, '{"result": "11"}'), (score, '{"result": "7'), (label, '{"result": "ok"}'),
                          (score, '{"other": "1"}'), (score, '{"result": true}'), (score, '{"result": "1e3"}')):
        assert read_judgement(grader, reply, 1).parse_error, reply
    with pytest.raises(SettingsError) as info:
        parse_grader({"type": "score_model", "name": "s", "model": "m", "input": [{"role": "user", "content": "x"}],
                      "sampling_params": {"reasoning_effort": "high"}})
    assert info.value.param == "grader.sampling_params.reasoning_effort"
