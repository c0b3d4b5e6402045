"""Structured output on `coserve serve --engine vllm` with the official client, on the tiny random qwen2
model (a tool template; its weights are noise, so only the grammar makes a reply valid): `parse` with a
pydantic model, streamed or not, `json_object`, forced tool calls (`required`, a named function, with
and without parallel calls) and their streams, logprobs under a grammar. vLLM's own structured output
enforces coserve's grammars (tests/vllm/test_vllm_structured.py: the same masks as coserve's engine).

A module of its own: one vLLM engine per module (test_vllm_models.py says why)."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import openai
import pytest
from pydantic import BaseModel, Field

from local_server import LocalServer, local_server
from tool_cases import check_forced_calls, check_streamed_calls
from vllm_support import require_vllm

require_vllm()
pytestmark = pytest.mark.vllm

from coserve.contract.engine import EngineKind  # noqa: E402

KEY = "sk-vllm-json-0123"
ASK = [{"role": "user", "content": "Describe a pet as JSON."}]


class Pet(BaseModel):
    """Bounded fields: a noise model cannot write past max_tokens inside one."""

    name: str = Field(max_length=8)
    kind: Literal["cat", "dog", "fish"]
    age: int = Field(ge=0, le=30)
    tags: list[Literal["calm", "loud"]] = Field(max_length=3)


@pytest.fixture(scope="module")
def server(model_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalServer]:
    with local_server(model_dirs["qwen2"], tmp_path_factory.mktemp("vllm-json"), {"t": {"api_keys": [KEY]}},
                      engine=EngineKind.VLLM) as srv:
        yield srv


def test_parse_gives_the_model_streamed_or_not(server: LocalServer) -> None:
    oa = server.client(KEY)
    reply = oa.chat.completions.parse(model=server.base, messages=ASK, response_format=Pet, n=4, temperature=1.2,
                                      seed=3, max_completion_tokens=120)
    for choice in reply.choices:
        assert choice.finish_reason == "stop", choice.message.content
        assert isinstance(choice.message.parsed, Pet)
    with oa.chat.completions.stream(model=server.base, messages=ASK, response_format=Pet, temperature=0.9, seed=5,
                                    max_completion_tokens=120) as stream:
        deltas = [event.delta for event in stream if event.type == "content.delta"]
        final = stream.get_final_completion()
    assert len(deltas) > 3 and "".join(deltas) == final.choices[0].message.content  # token by token
    assert isinstance(final.choices[0].message.parsed, Pet)


def test_json_object_replies_are_objects(server: LocalServer, model_dirs: dict[str, Path]) -> None:
    """Keys are unbounded strings, which noise writes until max_tokens; a bias towards "}" lets the object
    close at once (it cannot open one: only the grammar makes the reply start with "{")."""
    from transformers import AutoTokenizer

    close = AutoTokenizer.from_pretrained(model_dirs["qwen2"]).convert_tokens_to_ids("}")
    oa = server.client(KEY)
    for bias, finish in (({}, "length"), ({str(close): 100}, "stop")):
        reply = oa.chat.completions.create(model=server.base, messages=ASK, response_format={"type": "json_object"},
                                           logit_bias=bias, n=3, temperature=1.0, seed=1, max_completion_tokens=40)
        for choice in reply.choices:
            assert choice.message.content.startswith("{") and choice.finish_reason == finish
            if finish == "stop":
                assert isinstance(json.loads(choice.message.content), dict)


def test_forced_tool_calls_are_valid_calls(server: LocalServer) -> None:
    check_forced_calls(server.client(KEY), server.base)


def test_streamed_calls_reassemble_to_the_same_calls(server: LocalServer) -> None:
    check_streamed_calls(server.client(KEY), server.base)


def test_logprobs_under_a_grammar_are_finite_and_allowed(server: LocalServer) -> None:
    """vLLM's logprobs come after the grammar's mask: the tokens it forbids (-inf) are left out, so
    `top_logprobs` may list fewer than asked, and every value is a number JSON can carry."""
    reply = server.client(KEY).chat.completions.create(
        model=server.base, messages=ASK, response_format={"type": "json_schema", "json_schema": {
            "name": "pet", "schema": Pet.model_json_schema()}}, temperature=0, logprobs=True, top_logprobs=3,
        max_completion_tokens=60)
    content = reply.choices[0].logprobs.content
    assert content[0].token == "{" and [t.token for t in content[0].top_logprobs] == ["{"]
    assert all(math.isfinite(t.logprob) and len(t.top_logprobs) <= 3 for t in content)
    assert all(math.isfinite(top.logprob) for t in content for top in t.top_logprobs)
    assert any(len(t.top_logprobs) > 1 for t in content)


def test_what_a_grammar_cannot_honour_is_still_refused(server: LocalServer) -> None:
    """The gateway's checks, as on coserve's engine: a schema llguidance cannot enforce, and options that
    would keep a finished grammar's output going."""
    oa = server.client(KEY)
    unsupported = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {"type": "string"}}}}
    with pytest.raises(openai.BadRequestError) as info:
        oa.chat.completions.create(model=server.base, messages=ASK, response_format=unsupported)
    assert info.value.param == "response_format.json_schema.schema" and "not" in info.value.message
    for extra in ({"ignore_eos": True}, {"min_tokens": 2}):
        with pytest.raises(openai.BadRequestError) as info:
            oa.chat.completions.create(model=server.base, messages=ASK, response_format={"type": "json_object"},
                                       extra_body=extra)
        assert next(iter(extra)) in info.value.message
