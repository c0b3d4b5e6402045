"""Tools shared by the tool tests on both engines (test_tools.py, test_vllm_structured_server.py): two
functions, one with a bounded schema (a noise model cannot run past max_tokens inside an argument), and
the check that a reply's calls are valid."""

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
