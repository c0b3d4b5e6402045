"""`/v1/fine_tuning/alpha/graders/run` and `/validate` through the real `--local` server, driven by the
official `openai` client (`client.fine_tuning.alpha.graders`): every grader type coserve runs, OpenAI's
answer shape, and a 400 naming the field for what it cannot run."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from local_server import LocalServer, local_server

KEY = "sk-graders-tenant-0123"
EXACT = {"type": "string_check", "name": "exact", "input": "{{ sample.output_text }}",
         "reference": "{{ item.answer }}", "operation": "eq"}
ROUGE = {"type": "text_similarity", "name": "rouge", "input": "{{ sample.output_text }}",
         "reference": "{{ item.answer }}", "evaluation_metric": "rouge_1"}


@pytest.fixture(scope="module")
def server(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalServer]:
    with local_server(llama_dir, tmp_path_factory.mktemp("graders"), {"t": {"api_keys": [KEY]}}) as srv:
        yield srv


@pytest.fixture
def client(server: LocalServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)


def test_run_grades_string_similarity_and_multi(client: openai.OpenAI) -> None:
    graders = client.fine_tuning.alpha.graders
    exact = graders.run(grader=EXACT, model_sample="Paris", item={"answer": "Paris"})  # type: ignore[arg-type]
    assert exact.reward == 1.0 and exact.metadata.name == "exact" and exact.metadata.type == "string_check"
    assert not exact.metadata.errors.invalid_variable_error and exact.sub_rewards == {}
    rouge = graders.run(grader=ROUGE, model_sample="the cat sat on the mat",  # type: ignore[arg-type]
                        item={"answer": "the cat is on the mat"})
    assert rouge.reward == pytest.approx(5 / 6)
    multi = {"type": "multi", "name": "mix", "calculate_output": "0.25 * exact + 0.75 * rouge",
             "graders": {"exact": EXACT, "rouge": ROUGE}}
    mixed = graders.run(grader=multi, model_sample="the cat sat on the mat",  # type: ignore[arg-type]
                        item={"answer": "the cat is on the mat"})
    assert mixed.reward == pytest.approx(0.75 * 5 / 6) and mixed.metadata.type == "multi"
    assert mixed.sub_rewards == {"exact": 0.0, "rouge": pytest.approx(5 / 6)}
    missing = graders.run(grader=EXACT, model_sample="Paris", item={"question": "?"})  # type: ignore[arg-type]
    assert missing.reward == 0.0 and missing.metadata.errors.invalid_variable_error


def test_validate_echoes_a_grader_it_can_run(client: openai.OpenAI) -> None:
    answer = client.fine_tuning.alpha.graders.validate(grader=EXACT)  # type: ignore[arg-type]
    assert answer.grader is not None and answer.grader.model_dump(exclude_none=True) == EXACT


@pytest.mark.parametrize(("grader", "param"), [
    ({**EXACT, "operation": "regex"}, "grader.operation"),
    ({**EXACT, "reference": "{{ row.answer }}"}, "grader.reference"),
    ({**ROUGE, "evaluation_metric": "cosine"}, "grader.evaluation_metric"),
    ({"type": "python", "name": "p", "source": "def grade(sample, item):\n    return 1.0\n"}, "grader.type"),
    ({"type": "multi", "name": "m", "calculate_output": "exact + nope", "graders": {"exact": EXACT}},
     "grader.calculate_output"),
])
def test_what_cannot_run_is_a_400_naming_the_field(client: openai.OpenAI, grader: dict[str, Any],
                                                   param: str) -> None:
    for call in (lambda: client.fine_tuning.alpha.graders.validate(grader=grader),  # type: ignore[arg-type]
                 lambda: client.fine_tuning.alpha.graders.run(grader=grader, model_sample="x")):  # type: ignore[arg-type]
        with pytest.raises(openai.BadRequestError) as info:
            call()
        error = info.value.body
        assert isinstance(error, dict) and error["param"] == param and error["code"] == "invalid_grader"


def test_bad_bodies_are_400s(server: LocalServer) -> None:
    url, headers = f"{server.url}/v1/fine_tuning/alpha/graders/run", {"Authorization": f"Bearer {KEY}"}
    for body, param in (({"grader": EXACT}, "model_sample"), ({"grader": EXACT, "model_sample": 3}, "model_sample"),
                        ({"grader": EXACT, "model_sample": "x" * 70_000}, "model_sample"),
                        ({"grader": EXACT, "model_sample": "x", "item": [1]}, "item")):
        answer = httpx.post(url, json=body, headers=headers, timeout=30)
        assert answer.status_code == 400 and answer.json()["error"]["param"] == param, answer.text
    assert httpx.post(url, json={"grader": EXACT, "model_sample": "x"}, timeout=30).status_code == 401


def test_python_graders_run_when_the_operator_turns_them_on(llama_dir: Path, tmp_path: Path,
                                                            client: openai.OpenAI) -> None:
    python = {"type": "python", "name": "py",
              "source": "def grade(sample, item):\n    return float(sample['output_text'] == item['answer'])\n"}
    with pytest.raises(openai.BadRequestError) as info:  # off by default: the message says how to turn on
        client.fine_tuning.alpha.graders.validate(grader=python)  # type: ignore[arg-type]
    assert "--enable-python-graders" in str(info.value.body)
    with local_server(llama_dir, tmp_path, {"t": {"api_keys": [KEY]}}, enable_python_graders=True) as on:
        graders = openai.OpenAI(base_url=f"{on.url}/v1", api_key=KEY, max_retries=0).fine_tuning.alpha.graders
        assert graders.validate(grader=python).grader is not None  # type: ignore[arg-type]
        right = graders.run(grader=python, model_sample="Paris", item={"answer": "Paris"})  # type: ignore[arg-type]
        assert right.reward == 1.0 and right.metadata.type == "python"
        broken = graders.run(grader={**python, "source": "def grade(sample, item):\n    return item['x']\n"},  # type: ignore[arg-type]
                             model_sample="Paris", item={"answer": "Paris"})
        errors = broken.metadata.errors
        assert broken.reward == 0.0 and errors.python_grader_runtime_error
        assert "KeyError" in (errors.python_grader_runtime_error_details or "")


def test_model_graders_are_judged_by_a_served_model_as_the_tenant(server: LocalServer,
                                                                   client: openai.OpenAI) -> None:
    """The tiny random model judges: structured output holds its reply to the schema, so the verdict is
    always a label (or a number in range) whatever it thinks."""
    label = {"type": "label_model", "name": "judge", "model": server.base, "labels": ["yes", "no"],
             "passing_labels": ["yes"], "sampling_params": {"temperature": 0, "max_completions_tokens": 32},
             "input": [{"role": "user", "content": "Is '{{ sample.output_text }}' the answer to {{ item.q }}?"}]}
    graders = client.fine_tuning.alpha.graders
    judged = graders.run(grader=label, model_sample="Paris", item={"q": "the capital of France"})  # type: ignore[arg-type]
    errors = judged.metadata.errors
    assert judged.reward in (0.0, 1.0) and not errors.model_grader_parse_error, judged
    assert judged.metadata.type == "label_model" and judged.metadata.token_usage
    assert judged.model_grader_token_usage_per_model[server.base]["total_tokens"] == judged.metadata.token_usage
    both = {"type": "multi", "name": "both", "calculate_output": "0.5 * judge + 0.5 * exact",
            "graders": {"judge": label, "exact": {**EXACT, "reference": "Paris"}}}
    mixed = graders.run(grader=both, model_sample="Paris", item={"q": "x"})  # type: ignore[arg-type]
    assert mixed.sub_rewards["exact"] == 1.0 and mixed.reward == pytest.approx(0.5 * mixed.sub_rewards["judge"] + 0.5)
    # A score as the schema writes it: a number of at most six digits, so the reply always ends; a range
    # that holds any of them, as the random model's scores are random.
    score = {"type": "score_model", "name": "score", "model": server.base, "range": [-1e6, 1e6],
             "sampling_params": {"temperature": 0},
             "input": [{"role": "user", "content": "Score {{ sample.output_text }}"}]}
    scored = graders.run(grader=score, model_sample="Paris")  # type: ignore[arg-type]
    assert not scored.metadata.errors.model_grader_parse_error and -1e6 <= scored.reward <= 1e6, scored
    narrow = graders.run(grader={**score, "range": [0.0, 1e-9]}, model_sample="Paris")  # type: ignore[arg-type]
    assert narrow.metadata.errors.model_grader_parse_error == (scored.reward != 0.0)  # out of range: no reward
    missing = graders.run(grader=label, model_sample="Paris", item={})  # type: ignore[arg-type]
    assert missing.reward == 0.0 and missing.metadata.errors.invalid_variable_error
    with pytest.raises(openai.BadRequestError) as info:
        graders.validate(grader={**label, "model": "no-such-model"})  # type: ignore[arg-type]
    assert isinstance(info.value.body, dict) and info.value.body["param"] == "grader.model"
