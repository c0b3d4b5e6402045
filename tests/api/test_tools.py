"""Tools through the real `--local` server and the official client, on the tiny random qwen2 model
(Qwen's tool template; its weights are noise, so with `required` or a named function only the grammar
makes the reply a call): calls come back as `message.tool_calls` whose arguments validate against the
function's schema, streams reassemble (the client's stream helper) to the same calls, the whole loop
(call, `tool` result, next reply) runs, and what cannot be honoured is a 400 naming the param."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from local_server import LocalServer, local_server
from tool_cases import MESSAGES, NAMED, TOOLS, check_forced_calls, check_streamed_calls

KEY = "sk-tools-0123456789"


@pytest.fixture(scope="module")
def qwen(model_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalServer]:
    with local_server(model_dirs["qwen2"], tmp_path_factory.mktemp("tools"), {"t": {"api_keys": [KEY]}}) as srv:
        yield srv


def test_required_and_named_replies_are_valid_calls(qwen: LocalServer) -> None:
    check_forced_calls(qwen.client(KEY), qwen.base)


def test_streamed_calls_reassemble_to_the_same_calls(qwen: LocalServer) -> None:
    options = check_streamed_calls(qwen.client(KEY), qwen.base)
    raw = httpx.post(f"{qwen.url}/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
                     json={**options, "n": 1, "stream": True, "tool_choice": NAMED, "parallel_tool_calls": False},
                     timeout=60).text
    pieces = [json.loads(line[6:])["choices"][0]["delta"] for line in raw.splitlines()
              if line.startswith("data: {")]
    first, second = [d["tool_calls"][0] for d in pieces if d.get("tool_calls")]
    assert first["index"] == 0 and first["type"] == "function" and first["id"].startswith("call_")
    assert first["function"] == {"name": "get_weather", "arguments": ""}
    assert set(second) == {"index", "function"} and set(second["function"]) == {"arguments"}  # no nulls


def test_the_whole_loop_call_result_next_reply(qwen: LocalServer) -> None:
    oa = qwen.client(KEY)
    first = oa.chat.completions.create(model=qwen.base, messages=MESSAGES, tools=TOOLS, tool_choice=NAMED,
                                       parallel_tool_calls=False, seed=2, max_completion_tokens=100)
    message = first.choices[0].message
    call = message.tool_calls[0]
    result = "It is 18 degrees and sunny in Paris today."
    history = [*MESSAGES, message.model_dump(), {"role": "tool", "tool_call_id": call.id, "content": result}]
    second = oa.chat.completions.create(model=qwen.base, messages=history, tools=TOOLS, seed=2,
                                        max_completion_tokens=8)
    assert second.choices[0].finish_reason in ("stop", "length")
    without_result = {**history[-1], "content": "ok"}
    shorter = oa.chat.completions.create(model=qwen.base, messages=[*history[:-1], without_result], tools=TOOLS,
                                         max_completion_tokens=1)
    # The template rendered the call and the result into the prompt.
    assert second.usage.prompt_tokens > shorter.usage.prompt_tokens > first.usage.prompt_tokens


def test_a_streamed_call_goes_back_as_the_client_reassembled_it(qwen: LocalServer) -> None:
    oa = qwen.client(KEY)
    with oa.chat.completions.stream(model=qwen.base, messages=MESSAGES, tools=TOOLS, tool_choice=NAMED,
                                    parallel_tool_calls=False, seed=4, max_completion_tokens=100) as stream:
        message = stream.get_final_completion().choices[0].message
    assert message.tool_calls[0].index == 0  # the helper's own field: accepted back, ignored
    history = [*MESSAGES, message, {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "18C"}]
    reply = oa.chat.completions.create(model=qwen.base, messages=history, tools=TOOLS, max_completion_tokens=4)
    assert reply.choices[0].finish_reason in ("stop", "length")


def test_tools_are_rendered_with_auto_and_none(qwen: LocalServer) -> None:
    oa = qwen.client(KEY)
    plain = oa.chat.completions.create(model=qwen.base, messages=MESSAGES, max_completion_tokens=1)
    for choice in ("auto", "none"):
        reply = oa.chat.completions.create(model=qwen.base, messages=MESSAGES, tools=TOOLS, tool_choice=choice,
                                           max_completion_tokens=4, temperature=0)
        assert reply.usage.prompt_tokens > plain.usage.prompt_tokens + 50
        assert reply.choices[0].finish_reason in ("stop", "length")
        assert reply.choices[0].message.tool_calls is None  # noise: no call to read


def _refused(srv: LocalServer, body: dict) -> dict:
    response = httpx.post(f"{srv.url}/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
                          json={"model": srv.base, "messages": MESSAGES, "max_completion_tokens": 4, **body},
                          timeout=30)
    assert response.status_code == 400, response.text
    return response.json()["error"]


def _tool(name: str = "f", **function: object) -> dict:
    return {"type": "function", "function": {"name": name, **function}}


@pytest.mark.parametrize(("body", "param", "says"), [
    ({"tools": [_tool("bad name!")]}, "tools", "invalid name"),
    ({"tools": [_tool(), _tool()]}, "tools", "repeats the function name"),
    ({"tools": [{"type": "retrieval"}]}, "tools", "'type': 'function'"),
    ({"tools": []}, "tools", "non-empty"),
    ({"tools": [_tool(parameters={"type": "object", "not": {}})]}, "tools[0].function.parameters", '"not"'),
    ({"tools": [_tool(parameters={"type": "string"})]}, "tools[0].function.parameters", "type 'object'"),
    ({"tools": [_tool()], "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice",
     "'g'"),
    ({"tools": [_tool()], "tool_choice": "always"}, "tool_choice", "required"),
    ({"tool_choice": "auto"}, "tool_choice", "only allowed when 'tools'"),
    ({"parallel_tool_calls": True}, "parallel_tool_calls", "only allowed when 'tools'"),
    ({"tools": [_tool()], "parallel_tool_calls": "yes"}, "parallel_tool_calls", "boolean"),
    ({"tools": [_tool()], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "response_format", "forces a call"),
    ({"tools": [_tool()], "tool_choice": "required", "ignore_eos": True}, "tool_choice", "ignore_eos"),
    ({"messages": [{"role": "tool", "tool_call_id": "call_1", "content": "x"}]}, "messages",
     "answers no earlier tool call"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                                         "function": {"name": "f", "arguments": "{"}}]}]},
     "messages[0].tool_calls", "not valid JSON"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages[0].tool_calls",
     "only 'assistant'"),
    ({"functions": [{"name": "f"}]}, "functions", "use tools"),  # refused by param_support's table
    ({"functions": [{"name": "f"}], "function_call": "auto"}, "function_call", "deprecated"),
    ({"function_call": {"name": "f"}}, "function_call", "deprecated"),
])
def test_bad_tool_requests_are_400s_naming_the_param(qwen: LocalServer, body: dict, param: str,
                                                     says: str) -> None:
    error = _refused(qwen, body)
    assert error["param"] == param and says in error["message"], error
    assert error["type"] == "invalid_request_error"


def test_a_template_without_tools_forces_calls_it_describes_in_a_system_message(model_dirs: dict[str, Path],
                                                                                tmp_path: Path) -> None:
    """ChatML renders no tools: `required` and named calls still work (the tools described in a system
    message, the call forced in the hermes format it describes); `auto`, `none` and tool-call history
    are 400s."""
    with local_server(model_dirs["llama"], tmp_path, {"t": {"api_keys": [KEY]}}) as chatml:
        check_forced_calls(chatml.client(KEY), chatml.base)
        check_streamed_calls(chatml.client(KEY), chatml.base)
        oa = chatml.client(KEY)
        plain = oa.chat.completions.create(model=chatml.base, messages=MESSAGES, max_completion_tokens=1)
        forced = oa.chat.completions.create(model=chatml.base, messages=MESSAGES, tools=TOOLS, tool_choice=NAMED,
                                            parallel_tool_calls=False, max_completion_tokens=100)
        assert forced.usage.prompt_tokens > plain.usage.prompt_tokens + 50  # the description is in the prompt
        for choice in ("auto", "none"):
            error = _refused(chatml, {"tools": [_tool()], "tool_choice": choice})
            assert error["param"] == "tools" and "does not render tools" in error["message"]
            assert "'required'" in error["message"]
        history = [*MESSAGES, {"role": "assistant", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
                   {"role": "tool", "tool_call_id": "call_1", "content": "42"}]
        error = _refused(chatml, {"messages": history})
        assert error["param"] == "messages" and "tool calls or tool results" in error["message"]
        with pytest.raises(openai.BadRequestError) as info:
            oa.chat.completions.create(model=chatml.base, messages=MESSAGES, tools=[_tool()])
        assert info.value.param == "tools"


def test_history_may_call_functions_no_longer_offered(qwen: LocalServer) -> None:
    history = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_old", "type": "function", "function": {"name": "retired", "arguments": "{\"a\": 1}"}}]},
               {"role": "tool", "tool_call_id": "call_old", "content": "done"}]
    reply = qwen.client(KEY).chat.completions.create(model=qwen.base, messages=history, tools=TOOLS,
                                                     max_completion_tokens=2)
    assert reply.choices[0].finish_reason in ("stop", "length")
