"""A hostile tenant's graders against the real `--local` server through the official `openai` client: big
powers in a formula, a grader of thousands of graders, similarity work past its bound, and a flood of the
heaviest grading allowed. Each is an OpenAI-style grader error or a 4xx naming the field, never a 500;
the victim's grading and `/health` stay fast throughout."""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from coserve.api.serving import graders as grader_service
from coserve.contract.grader import parse_grader
from local_server import LocalServer, local_server

ATTACKER, VICTIM = "sk-attacker-graders-01234", "sk-victim-graders-01234"
EXACT = {"type": "string_check", "name": "exact", "input": "{{ sample.output_text }}",
         "reference": "{{ item.answer }}", "operation": "eq"}
WORDS = "word " * 1000  # 1,000 words: a rouge_l of it against itself is the most one sample may ask (~1 s)


@pytest.fixture(scope="module")
def server(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalServer]:
    tenants = {"attacker": {"api_keys": [ATTACKER]}, "victim": {"api_keys": [VICTIM]}}
    with local_server(llama_dir, tmp_path_factory.mktemp("bounds"), tenants) as srv:
        yield srv


def health_s(server: LocalServer) -> float:
    start = time.monotonic()
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    return time.monotonic() - start


def victim_grades(server: LocalServer) -> float:
    """Seconds the victim's string check takes, checked correct."""
    start = time.monotonic()
    result = server.client(VICTIM).fine_tuning.alpha.graders.run(grader=EXACT, model_sample="Paris",  # type: ignore[arg-type]
                                                                 item={"answer": "Paris"})
    assert result.reward == 1.0
    return time.monotonic() - start


def multi(formula: str) -> dict[str, Any]:
    return {"type": "multi", "name": "m", "calculate_output": formula, "graders": {"exact": EXACT}}


@pytest.mark.parametrize("formula", ["1000 ^ 1000", "4000000 ^ 1000000 * exact", "exp(1000) - exp(1000)"])
def test_big_powers_are_a_formula_error_at_once(server: LocalServer, formula: str) -> None:
    start = time.monotonic()
    result = server.client(ATTACKER).fine_tuning.alpha.graders.run(grader=multi(formula), model_sample="x",  # type: ignore[arg-type]
                                                                   item={"answer": "x"})
    assert result.reward == 0.0 and result.metadata.errors.formula_parse_error
    assert time.monotonic() - start < 1.0 and health_s(server) < 1.0


def test_a_formula_that_can_never_have_a_value_is_a_400(server: LocalServer) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        server.client(ATTACKER).fine_tuning.alpha.graders.run(grader=multi("9" * 400), model_sample="x")  # type: ignore[arg-type]
    assert isinstance(info.value.body, dict) and info.value.body["param"] == "grader.calculate_output"


def test_a_grader_of_thousands_of_graders_is_a_400(server: LocalServer) -> None:
    rouge = {"type": "text_similarity", "name": "r", "input": "{{ sample.output_text }}", "reference": "x",
             "evaluation_metric": "rouge_l"}
    level = {"type": "multi", "name": "l", "calculate_output": "g0", "graders": {f"g{i}": rouge for i in range(32)}}
    wide = {"type": "multi", "name": "w", "calculate_output": "g0", "graders": {f"g{i}": level for i in range(32)}}
    huge = {"type": "multi", "name": "h", "calculate_output": "g0", "graders": {f"g{i}": wide for i in range(8)}}
    start = time.monotonic()
    with pytest.raises(openai.BadRequestError) as info:  # 8,192 rouge_l graders
        server.client(ATTACKER).fine_tuning.alpha.graders.run(grader=huge, model_sample=WORDS)  # type: ignore[arg-type]
    body = info.value.body
    assert isinstance(body, dict) and body["param"] == "grader" and body["code"] == "invalid_grader", body
    assert "at most 64" in body["message"] and time.monotonic() - start < 5.0


def test_a_grader_is_parsed_off_the_event_loop(server: LocalServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """Building and checking a grader of thousands of graders holds the GIL for 0.1 s (a quiet machine; a
    loaded one took /health to 0.7 s): it runs in a thread, the event loop serving /health in between."""
    on_loop: list[bool] = []

    def parse(raw: dict[str, Any]) -> Any:
        try:
            asyncio.get_running_loop()
            on_loop.append(True)
        except RuntimeError:
            on_loop.append(False)
        return parse_grader(raw)

    monkeypatch.setattr(grader_service, "parse_grader", parse)
    rouge = {"type": "text_similarity", "name": "r", "input": "{{ sample.output_text }}", "reference": "x",
             "evaluation_metric": "rouge_l"}
    level = {"type": "multi", "name": "l", "calculate_output": "g0", "graders": {f"g{i}": rouge for i in range(32)}}
    huge = {"type": "multi", "name": "h", "calculate_output": "g0", "graders": {f"g{i}": level for i in range(32)}}
    with pytest.raises(openai.BadRequestError):
        server.client(ATTACKER).fine_tuning.alpha.graders.run(grader=huge, model_sample="x")  # type: ignore[arg-type]
    victim_grades(server)
    assert on_loop == [False, False]


def test_similarity_work_past_its_bound_scores_zero_with_other_error(server: LocalServer) -> None:
    rouge = {"type": "text_similarity", "name": "r", "input": "{{ sample.output_text }}",
             "reference": "{{ item.answer }}", "evaluation_metric": "rouge_l"}
    text = "word " * 1999
    start = time.monotonic()
    result = server.client(ATTACKER).fine_tuning.alpha.graders.run(grader=rouge, model_sample=text,  # type: ignore[arg-type]
                                                                   item={"answer": text})
    assert result.reward == 0.0 and result.metadata.errors.other_error
    assert time.monotonic() - start < 1.0  # about 4 s of ROUGE-L when it ran


def test_a_flood_of_the_heaviest_grading_allowed_leaves_the_victim_fast(server: LocalServer) -> None:
    heavy = {"type": "text_similarity", "name": "r", "input": "{{ sample.output_text }}",
             "reference": "{{ item.answer }}", "evaluation_metric": "rouge_l"}
    attacker = server.client(ATTACKER)

    def attack() -> str:
        try:
            result = attacker.fine_tuning.alpha.graders.run(grader=heavy, model_sample=WORDS,  # type: ignore[arg-type]
                                                            item={"answer": WORDS})
        except openai.RateLimitError:
            return "429"
        assert not result.metadata.errors.other_error and result.reward == 1.0
        return "graded"

    quiet = victim_grades(server)
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        flood = [pool.submit(attack) for _ in range(16)]
        time.sleep(1.0)  # the attacker's calls hold their threads and fill their line
        loaded = [victim_grades(server) for _ in range(3)]
        healths = [health_s(server) for _ in range(3)]
        outcomes = [f.result(timeout=120) for f in flood]
    assert max(loaded) < 2.0 + quiet, (quiet, loaded)  # FIFO: behind up to 16 x ~1 s of ROUGE-L
    assert max(healths) < 1.0, healths
    assert "graded" in outcomes and "429" in outcomes, outcomes  # a tenant's line is bounded
