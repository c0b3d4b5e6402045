"""`POST /v1/responses` through the real `--local` server and the official client, on the tiny random qwen2
model (Qwen's hermes tool template; its weights are noise, so only a grammar makes a reply a call or JSON):
string and item inputs, `instructions`, function tools as `function_call` items (streamed too, never text),
`text.format` with `responses.parse`, `max_output_tokens` -> `incomplete`, usage with `cached_tokens`, the
stream's events in the order the client's `responses.stream()` checks, and the 400s naming what coserve
cannot honour."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pydantic
import pytest

from local_server import LocalServer, local_server
from tool_cases import WEATHER_SCHEMA

KEY = "sk-responses-0123456789"
TOOLS: list[Any] = [{"type": "function", "name": "get_weather", "description": "The weather in a city",
                     "parameters": WEATHER_SCHEMA, "strict": True},
                    {"type": "function", "name": "now", "description": "The time", "parameters": None, "strict": None}]
NAMED = {"type": "function", "name": "get_weather"}


@pytest.fixture(scope="module")
def qwen(model_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalServer]:
    with local_server(model_dirs["qwen2"], tmp_path_factory.mktemp("responses"), {"r": {"api_keys": [KEY]}}) as srv:
        yield srv


def test_a_string_input_gives_a_message_and_usage(qwen: LocalServer) -> None:
    oa = qwen.client(KEY)
    reply = oa.responses.create(model=qwen.base, input="Hello there", max_output_tokens=6, temperature=0,
                                instructions="Answer briefly.", metadata={"k": "v"})
    assert reply.id.startswith("resp_") and reply.object == "response" and reply.model == qwen.base
    assert reply.status == "incomplete" and reply.incomplete_details.reason == "max_output_tokens"
    [message] = reply.output
    assert message.type == "message" and message.id.startswith("msg_") and message.status == "incomplete"
    assert message.content[0].type == "output_text" and reply.output_text == message.content[0].text
    usage = reply.usage
    assert usage.output_tokens == 6 and usage.total_tokens == usage.input_tokens + 6
    assert usage.input_tokens_details.cached_tokens == 0 and usage.output_tokens_details.reasoning_tokens == 0
    assert reply.instructions == "Answer briefly." and reply.metadata == {"k": "v"} and reply.store is True
    # The same prompt again: its full blocks come from the prefix cache.
    again = oa.responses.create(model=qwen.base, input="Hello there", max_output_tokens=6, temperature=0,
                                instructions="Answer briefly.")
    assert again.output_text == reply.output_text
    cached = again.usage.input_tokens_details.cached_tokens
    assert 0 < cached < again.usage.input_tokens and cached % 16 == 0


def test_items_render_as_the_same_chat_conversation(qwen: LocalServer) -> None:
    """Items (an assistant output sent back as the client holds it, a developer message) give the reply
    chat gives for the same messages."""
    oa = qwen.client(KEY)
    first = oa.responses.create(model=qwen.base, input="Hi", max_output_tokens=3, temperature=0)
    items = [{"role": "user", "content": "Hi"}, first.output[0].model_dump(exclude_none=True),
             {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Be kind."}]},
             {"role": "user", "content": [{"type": "input_text", "text": "And then?"}]}]
    reply = oa.responses.create(model=qwen.base, input=items, instructions="You help.", max_output_tokens=5,
                                temperature=0)
    messages = [{"role": "system", "content": "You help."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": first.output_text}, {"role": "developer", "content": "Be kind."},
                {"role": "user", "content": "And then?"}]
    chat = oa.chat.completions.create(model=qwen.base, messages=messages, max_completion_tokens=5, temperature=0)
    assert reply.output_text == chat.choices[0].message.content
    assert reply.usage.input_tokens == chat.usage.prompt_tokens


def _calls(reply: Any) -> list[Any]:
    calls = [item for item in reply.output if item.type == "function_call"]
    for call in calls:
        assert call.id.startswith("fc_") and call.call_id.startswith("call_") and call.status == "completed"
        if call.name == "get_weather":
            jsonschema.validate(json.loads(call.arguments), WEATHER_SCHEMA)
    return calls


def test_forced_calls_are_function_call_items(qwen: LocalServer) -> None:
    oa = qwen.client(KEY)
    named = oa.responses.create(model=qwen.base, input="Weather in Paris?", tools=TOOLS, tool_choice=NAMED,
                                parallel_tool_calls=False, max_output_tokens=100, extra_body={"seed": 5})
    assert named.status == "completed" and [c.name for c in _calls(named)] == ["get_weather"]
    assert [item.type for item in named.output] == ["function_call"]  # no text around a forced call
    required = oa.responses.create(model=qwen.base, input="Anything?", tools=TOOLS, tool_choice="required",
                                   max_output_tokens=400, extra_body={"seed": 3})
    assert required.status == "completed" and len(_calls(required)) >= 1
    assert required.tools[0].name == "get_weather" and required.tool_choice == "required"


def _raw_events(srv: LocalServer, body: dict[str, Any]) -> list[dict[str, Any]]:
    text = httpx.post(f"{srv.url}/v1/responses", headers={"Authorization": f"Bearer {KEY}"},
                      json={**body, "stream": True}, timeout=60).text
    events = []
    for block in text.strip().split("\n\n"):
        kind, data = block.split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert kind == f"event: {event['type']}"
        events.append(event)
    return events


def test_streamed_call_events_in_order_and_the_same_response(qwen: LocalServer) -> None:
    body = {"model": qwen.base, "input": "Weather?", "tools": TOOLS, "tool_choice": NAMED,
            "parallel_tool_calls": False, "max_output_tokens": 100, "seed": 11}
    events = _raw_events(qwen, body)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed"]
    added, done = events[2]["item"], events[5]["item"]
    assert added["type"] == "function_call" and added["arguments"] == "" and added["status"] == "in_progress"
    assert done["id"] == added["id"] and done["arguments"] == events[4]["arguments"] == events[3]["delta"]
    oa = qwen.client(KEY)
    with oa.responses.stream(**{k: v for k, v in body.items() if k != "seed"}, extra_body={"seed": 11}) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert kinds == [e["type"] for e in events]
    whole = oa.responses.create(**{k: v for k, v in body.items() if k != "seed"}, extra_body={"seed": 11})
    assert [(c.name, c.arguments) for c in _calls(final)] == [(c.name, c.arguments) for c in _calls(whole)]
    assert oa.responses.retrieve(final.id).output[0].arguments == final.output[0].arguments


def test_streamed_text_events_and_incomplete(qwen: LocalServer) -> None:
    events = _raw_events(qwen, {"model": qwen.base, "input": "Tell me", "max_output_tokens": 7, "temperature": 0})
    kinds = [e["type"] for e in events]
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[4:4 + len(deltas)] == ["response.output_text.delta"] * len(deltas)
    assert kinds[4 + len(deltas):] == ["response.output_text.done", "response.content_part.done",
                                       "response.output_item.done", "response.incomplete"]
    text = "".join(d["delta"] for d in deltas)
    final = events[-1]["response"]
    assert final["status"] == "incomplete" and final["output"][0]["content"][0]["text"] == text
    assert final["usage"]["output_tokens"] == 7 and events[-4]["text"] == text


class Weather(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    unit: str = pydantic.Field(json_schema_extra={"enum": ["c", "f"]})
    days: int = pydantic.Field(ge=1, le=7)


def test_parse_with_a_pydantic_text_format(qwen: LocalServer) -> None:
    oa = qwen.client(KEY)
    parsed = oa.responses.parse(model=qwen.base, input="JSON please", text_format=Weather, max_output_tokens=200,
                                extra_body={"seed": 4})
    assert parsed.status == "completed"
    assert isinstance(parsed.output_parsed, Weather) and 1 <= parsed.output_parsed.days <= 7
    reply = oa.responses.create(model=qwen.base, input="JSON", text={"format": {"type": "json_object"}},
                                max_output_tokens=200, extra_body={"seed": 4})
    assert reply.status in ("completed", "incomplete")
    if reply.status == "completed":
        assert isinstance(json.loads(reply.output_text), dict)


def test_logprobs_with_include(qwen: LocalServer) -> None:
    reply = qwen.client(KEY).responses.create(model=qwen.base, input="Hi", max_output_tokens=3, top_logprobs=2,
                                              include=["message.output_text.logprobs"], temperature=0)
    logprobs = reply.output[0].content[0].logprobs
    assert len(logprobs) == 3 and all(len(lp.top_logprobs) == 2 and lp.logprob <= 0 for lp in logprobs)
    assert "".join(lp.token for lp in logprobs) == reply.output_text


@pytest.mark.parametrize(("kwargs", "param", "code"), [
    ({"tools": [{"type": "web_search"}]}, "tools[0].type", "invalid_value"),
    ({"tools": [{"type": "code_interpreter", "container": {"type": "auto"}}]}, "tools[0].type", "invalid_value"),
    ({"input": [{"type": "file_search_call", "id": "x", "queries": [], "status": "completed"}]}, "input[0].type",
     "invalid_value"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/a.png"}]}]},
     "input[0].content[0].type", "invalid_value"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt", "unsupported_parameter"),
    ({"conversation": "conv_1"}, "conversation", "unsupported_parameter"),
    ({"reasoning": {"effort": "high"}}, "reasoning", "unsupported_parameter"),
    ({"truncation": "auto"}, "truncation", "unsupported_value"),
    ({"text": {"verbosity": "low"}}, "text.verbosity", "unsupported_parameter"),
    ({"include": ["file_search_call.results"]}, "include[0]", "invalid_value"),
    ({"extra_body": {"max_output_token": 3}}, "max_output_token", "unknown_parameter"),
    ({"tools": [{"type": "function", "name": "f", "parameters": None, "strict": None, "strictt": 1}]},
     "tools[0].strictt", "unknown_parameter"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice", "invalid_value"),
    ({"tool_choice": "required"}, "tool_choice", "invalid_value"),
    ({"background": True, "store": False}, "background", "invalid_value"),
    ({"previous_response_id": "resp_nope"}, "previous_response_id", "response_not_found"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": "x"}]}, "input", "invalid_value"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type", "invalid_value"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_what_coserve_cannot_honour_is_a_400_naming_it(qwen: LocalServer, kwargs: dict[str, Any], param: str,
                                                        code: str) -> None:
    request: dict[str, Any] = {"model": qwen.base, "input": "Hi", "max_output_tokens": 2, **kwargs}
    with pytest.raises(openai.APIStatusError) as info:
        qwen.client(KEY).responses.create(**request)
    assert info.value.status_code == (404 if code == "response_not_found" else 400), info.value.body
    assert (info.value.body["param"], info.value.body["code"]) == (param, code), info.value.body


def test_a_model_other_tenants_own_or_unknown_is_404(qwen: LocalServer) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        qwen.client(KEY).responses.create(model="ft:nope", input="Hi")
    assert info.value.body["code"] == "model_not_found"


def test_auto_tools_with_a_text_format_reply_calls_or_that_format(qwen: LocalServer) -> None:
    """The Agents SDK sends its tools with its `output_type`'s `text.format`: each reply is valid calls or
    valid JSON of the format (a grammar of both), and a forcing `tool_choice` beside a format is a call."""
    oa = qwen.client(KEY)
    fmt = {"format": {"type": "json_schema", "name": "w", "strict": True, "schema": Weather.model_json_schema()}}
    kinds = set()
    for seed in range(4):
        reply = oa.responses.create(model=qwen.base, input="Weather?", tools=TOOLS, text=fmt, max_output_tokens=300,
                                    parallel_tool_calls=False, extra_body={"seed": seed})
        assert reply.status == "completed", reply
        calls = _calls(reply)
        if not calls:
            Weather.model_validate_json(reply.output_text)
        kinds.add("calls" if calls else "json")
    assert kinds  # which one a noise model picks is its own business; both are valid
    forced = oa.responses.create(model=qwen.base, input="Weather?", tools=TOOLS, text=fmt, tool_choice="required",
                                 parallel_tool_calls=False, max_output_tokens=100, extra_body={"seed": 1})
    assert [item.type for item in forced.output] == ["function_call"]
