"""Tools shared by the tool tests on both engines (test_tools.py, test_vllm_structured_server.py): two
functions, one with a bounded schema (a noise model cannot run past max_tokens inside an argument), the
check that a reply's calls are valid, and the forced-call and streaming checks both engines pass."""

from __future__ import annotations

import json
from typing import Any

import jsonschema

WEATHER_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                  "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]},
                                 "days": {"type": "integer", "minimum": 1, "maximum": 7}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": WEATHER_SCHEMA, "strict": True}},
         {"type": "function", "function": {"name": "now", "description": "The time"}}]
SCHEMAS = {"get_weather": WEATHER_SCHEMA, "now": {"type": "object", "additionalProperties": False}}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def valid_calls(calls: list[Any]) -> list[tuple[str, dict]]:
    """(name, arguments) of each call, after checking its id, type and arguments against its schema."""
    out = []
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, SCHEMAS[call.function.name])
        out.append((call.function.name, arguments))
    return out


def check_forced_calls(oa: Any, model: str) -> None:
    """`tool_choice` "required" (sampled, n=4) and a named function (n=3) give only valid calls."""
    reply = oa.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                       n=4, temperature=1.0, seed=3, max_completion_tokens=400)
    for choice in reply.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert 1 <= len(valid_calls(choice.message.tool_calls))
    named = oa.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, tool_choice=NAMED,
                                       parallel_tool_calls=False, n=3, seed=5, max_completion_tokens=100)
    for choice in named.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        [(name, _)] = valid_calls(choice.message.tool_calls)
        assert name == "get_weather"


def check_streamed_calls(oa: Any, model: str) -> dict[str, Any]:
    """Streamed forced calls reassemble, through the official client, to the calls of the same request
    not streamed (same seeds); returns the request's options for further checks."""
    options = {"model": model, "messages": MESSAGES, "tools": TOOLS, "tool_choice": "required", "n": 2,
               "seed": 11, "temperature": 1.0, "max_completion_tokens": 400}
    whole = oa.chat.completions.create(**options).choices
    with oa.chat.completions.stream(**options) as stream:
        events = [event.type for event in stream]
        streamed = stream.get_final_completion().choices
    assert len(streamed) == 2
    for one, other in zip(streamed, whole, strict=True):
        assert one.finish_reason == "tool_calls" and one.message.content is None
        assert valid_calls(one.message.tool_calls) == valid_calls(other.message.tool_calls)  # same seeds
    assert "tool_calls.function.arguments.done" in events
    return options
