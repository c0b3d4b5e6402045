"""Tools through the real `--local` server and the official client on the Llama 3.x JSON and Mistral
`[TOOL_CALLS]` families: tiny random models whose chat templates are the real Llama 3.2 and Mistral Nemo
ones (their weights are noise, so only the grammar makes a `required` or named reply a call). Forced
calls come back as valid `tool_calls`, streamed ones reassemble to the same calls in OpenAI's delta
shape, and the whole loop (call, `tool` result, next reply) renders through the template, Mistral's
9-character call ids included. The hermes family: test_tools.py."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from local_server import LocalServer, local_server
from tool_cases import MESSAGES, NAMED, TOOLS, check_forced_calls, check_streamed_calls, valid_calls

KEY = "sk-tool-families-0123456789"


@pytest.fixture(scope="module", params=["llama3.2", "mistral"])
def server(request: pytest.FixtureRequest, tool_model_dirs: dict[str, Path],
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalServer]:
    with local_server(tool_model_dirs[request.param], tmp_path_factory.mktemp("families"),
                      {"t": {"api_keys": [KEY]}}) as srv:
        yield srv


def test_required_and_named_replies_are_valid_calls(server: LocalServer) -> None:
    check_forced_calls(server.client(KEY), server.base)


def test_streamed_calls_reassemble_in_openais_delta_shape(server: LocalServer) -> None:
    options = check_streamed_calls(server.client(KEY), server.base)
    raw = httpx.post(f"{server.url}/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
                     json={**options, "n": 1, "stream": True, "tool_choice": NAMED, "parallel_tool_calls": False},
                     timeout=60).text
    chunks = [json.loads(line[6:])["choices"][0] for line in raw.splitlines() if line.startswith("data: {")]
    first, second = [c["delta"]["tool_calls"][0] for c in chunks if c["delta"].get("tool_calls")]
    assert first["index"] == 0 and first["type"] == "function" and first["id"].startswith("call_")
    assert first["function"] == {"name": "get_weather", "arguments": ""}
    assert set(second) == {"index", "function"} and set(second["function"]) == {"arguments"}
    assert chunks[-1]["finish_reason"] == "tool_calls"
    assert not any(c["delta"].get("content") for c in chunks)  # the call's text is not content


def test_the_whole_loop_renders_through_the_template(server: LocalServer) -> None:
    oa = server.client(KEY)
    first = oa.chat.completions.create(model=server.base, messages=MESSAGES, tools=TOOLS, tool_choice=NAMED,
                                       parallel_tool_calls=False, seed=2, max_completion_tokens=100)
    message = first.choices[0].message
    [(name, _)] = valid_calls(message.tool_calls)
    assert name == "get_weather"
    result = {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "18 degrees and sunny"}
    history = [*MESSAGES, message.model_dump(), result]
    second = oa.chat.completions.create(model=server.base, messages=history, tools=TOOLS, seed=2,
                                        max_completion_tokens=8)
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    shorter = oa.chat.completions.create(model=server.base, messages=[*history[:-1], {**result, "content": "ok"}],
                                         tools=TOOLS, max_completion_tokens=1)
    # The template rendered the call and the result into the prompt.
    assert second.usage.prompt_tokens > shorter.usage.prompt_tokens > first.usage.prompt_tokens


def test_auto_and_none_render_the_tools(server: LocalServer) -> None:
    oa = server.client(KEY)
    plain = oa.chat.completions.create(model=server.base, messages=MESSAGES, max_completion_tokens=1)
    for choice in ("auto", "none"):
        reply = oa.chat.completions.create(model=server.base, messages=MESSAGES, tools=TOOLS, tool_choice=choice,
                                           max_completion_tokens=4, temperature=0)
        assert reply.usage.prompt_tokens > plain.usage.prompt_tokens + 50
        assert reply.choices[0].finish_reason in ("stop", "length")
