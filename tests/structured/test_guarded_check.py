"""The grammar check's budget: a spec that makes llguidance allocate or compute past it is refused, in a
worker process that dies or is killed in its place, and the checker goes on answering. The specs here
are built directly (not through the bounding constructors) to stand for what the limits might miss."""

from __future__ import annotations

import asyncio
import json
import resource
import threading
from collections.abc import Iterator

import pytest

from coserve.contract.structured_output import OutputFormat, StructuredOutput, StructuredOutputError
from coserve.structured.guarded_check import CheckBudget, GrammarCheck

# 168 million array items: llguidance 1.7 allocates until the kernel stops it (issue 28).
UNBOUNDED = StructuredOutput(OutputFormat.JSON_SCHEMA, '{"minItems": 167966261}')
# 5,000 optional properties: compiling takes ~0.5 s (quadratic in one object's optional properties).
SLOW = StructuredOutput(OutputFormat.JSON_SCHEMA, json.dumps(
    {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(5000)}}))


@pytest.fixture
def grammars() -> Iterator[GrammarCheck]:
    check = GrammarCheck()
    yield check
    check.close()


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def test_a_spec_past_the_memory_budget_costs_a_refusal_and_nothing_else(grammars: GrammarCheck) -> None:
    before = _peak_rss_mb()
    with pytest.raises(StructuredOutputError, match="too large to enforce: compiling it needs more than 512 MiB"):
        grammars.check(UNBOUNDED)
    assert _peak_rss_mb() - before < 100  # the worker took the blow, not this process
    grammars.check(StructuredOutput.json_schema({"type": "object"}))  # a fresh worker answers
    with pytest.raises(StructuredOutputError, match="Unimplemented keys"):
        grammars.check(StructuredOutput.json_schema({"not": {}}))
    assert grammars.error(UNBOUNDED) is not None  # remembered: refused again without a worker


def test_a_spec_past_the_time_budget_is_refused_and_remembered_for_a_while() -> None:
    grammars = GrammarCheck(CheckBudget(timeout_s=0.05))
    try:
        with pytest.raises(StructuredOutputError, match="takes more than 0.05 s"):
            grammars.check(SLOW)
        grammars.check(StructuredOutput.json_schema({"type": "integer"}))
    finally:
        grammars.close()
    patient = GrammarCheck(CheckBudget(timeout_s=30.0))
    try:
        patient.check(SLOW)  # the same spec fits a larger budget: the refusal was the budget's
    finally:
        patient.close()


def test_threads_share_the_workers_and_each_gets_its_own_answer() -> None:
    grammars = GrammarCheck(CheckBudget(workers=2))
    specs = [StructuredOutput.json_schema({"type": "array", "maxItems": n}) for n in range(1, 13)]
    specs += [StructuredOutput.json_schema({"not": {"const": n}}) for n in range(4)] + [UNBOUNDED]
    answers: dict[int, str | None] = {}

    def ask(i: int) -> None:
        answers[i] = grammars.error(specs[i])

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(specs))]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
    finally:
        grammars.close()
    assert [answers[i] is None for i in range(len(specs))] == [True] * 12 + [False] * 5
    assert all("Unimplemented" in answers[i] for i in range(12, 16))
    assert "too large" in answers[16]


def test_the_async_check_leaves_the_loop_free() -> None:
    grammars = GrammarCheck()

    async def main() -> int:
        ticks = 0

        async def tick() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.01)

        ticker = asyncio.create_task(tick())
        with pytest.raises(StructuredOutputError):
            await grammars.check_async(UNBOUNDED)
        await grammars.check_async(SLOW)
        ticker.cancel()
        return ticks

    try:
        assert asyncio.run(main()) > 5  # the loop ran while the workers compiled
    finally:
        grammars.close()


def test_a_closed_checker_still_answers_with_fresh_workers(grammars: GrammarCheck) -> None:
    grammars.check(StructuredOutput.json_object())
    grammars.close()
    grammars.check(StructuredOutput.json_schema({"type": "boolean"}))
