"""Hostile chat requests: every size a client controls, pushed past its limit (docs/limits.md).

Each entry is a name and the body of one `POST /v1/chat/completions`, with what the server must answer:
`REFUSED` (a 4xx naming a param) or `SERVED` (a 200 whose cost is bounded by the request's own limits).
The hostile-input tests (tests/api/test_hostile_inputs.py) send each to a real server and watch its
memory and /health; the soak (benchmarks/soak.py) sends them beside chat and a fine-tuning job.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from typing import Any

# Where a body holds a list nested deeper than any JSON encoder recurses: written into the text.
DEEP = "__deep_list__"


class Outcome(enum.Enum):
    REFUSED = "a 4xx"
    SERVED = "a 200"


@dataclass(frozen=True, slots=True)
class Attack:
    """One hostile request: its body (without `model`), the outcome it must get, and for a refusal the
    start of the `param` the error must name (None: any)."""

    body: dict[str, Any]
    outcome: Outcome
    param: str | None = None
    depth: int = 0  # the nesting of the list written where the body says DEEP

    def text(self, model: str) -> str:
        """The request body as JSON text."""
        text = json.dumps({"model": model, **self.body})
        return text.replace(json.dumps(DEEP), "[" * self.depth + "]" * self.depth)


def _schema(schema: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "Reply in JSON."}], "max_tokens": 8,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}


def _nested(levels: int, leaf: Any) -> Any:
    for _ in range(levels):
        leaf = {"type": "array", "items": leaf}
    return leaf


def _deep_list(levels: int) -> list[Any]:
    value: list[Any] = []
    for _ in range(levels):
        value = [value]
    return value


_SCHEMA = "response_format.json_schema.schema"


def grammar_attacks() -> dict[str, Attack]:
    """Schemas that cost llguidance (1.7, as vLLM 0.32 pins it) memory or time without bound."""
    many_optional = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(5000)}}
    arrays = {"type": "object", "properties": {f"a{i}": {"type": "array", "maxItems": 9000} for i in range(3)}}
    return {
        "min_items_untyped": Attack(_schema({"minItems": 167966261}), Outcome.REFUSED, f"{_SCHEMA}.minItems"),
        "max_items_nested": Attack(_schema({"type": "object", "properties": {"a": {
            "type": "array", "maxItems": 10**9}}}), Outcome.REFUSED, f"{_SCHEMA}.properties.a.maxItems"),
        "items_summed": Attack(_schema(arrays), Outcome.REFUSED, f"{_SCHEMA}.properties.a2.maxItems"),
        "min_length": Attack(_schema({"type": "string", "minLength": 167966261}), Outcome.REFUSED,
                             f"{_SCHEMA}.minLength"),
        "max_properties": Attack(_schema({"type": "object", "maxProperties": 10**12}), Outcome.REFUSED),
        "pattern_nested_counts": Attack(_schema({"type": "string", "pattern": "^((a{100}){100}){100}$"}),
                                        Outcome.REFUSED, f"{_SCHEMA}.pattern"),
        "optional_properties": Attack(_schema(many_optional), Outcome.REFUSED, f"{_SCHEMA}.properties"),
        "enum_values": Attack(_schema({"enum": list(range(5000))}), Outcome.REFUSED, f"{_SCHEMA}.enum"),
        "prefix_items": Attack(_schema({"type": "array", "prefixItems": [{"type": "null"}] * 5000}),
                               Outcome.REFUSED, f"{_SCHEMA}.prefixItems"),
        "nesting": Attack(_schema(_nested(200, {"type": "string"})), Outcome.REFUSED, _SCHEMA),
        "json_depth_in_enum": Attack(_schema({"enum": [_deep_list(500)]}), Outcome.REFUSED, _SCHEMA),
        "unsupported_keyword": Attack(_schema({"not": {"type": "string"}}), Outcome.REFUSED, _SCHEMA),
        "tool_parameters": Attack({
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {
                "type": "object", "properties": {"xs": {"type": "array", "minItems": 10**8}}}}}]},
            Outcome.REFUSED, "tools[0].function.parameters.properties.xs.minItems"),
        "too_many_tools": Attack({"messages": [{"role": "user", "content": "hi"}], "tools": [
            {"type": "function", "function": {"name": f"f{i}"}} for i in range(2000)]}, Outcome.REFUSED, "tools"),
        "schema_within_limits": Attack(_schema({"type": "object", "properties": {"a": {
            "type": "array", "maxItems": 10000, "items": {"type": "integer"}}}, "required": ["a"]}),
            Outcome.SERVED),
    }


def sampling_attacks(vocab_size: int) -> dict[str, Attack]:
    """Sampling and body sizes past their limits (or served within the request's own bounds)."""
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    return {
        "logit_bias_200k": Attack({**chat, "logit_bias": {str(i): 1 for i in range(200_000)}},
                                  Outcome.REFUSED, "logit_bias"),
        "logit_bias_whole_vocabulary": Attack({**chat, "logit_bias": {str(i): -1 for i in range(vocab_size)}},
                                              Outcome.SERVED),
        "stop_20k": Attack({**chat, "stop": [f"s{i}" for i in range(20_000)]}, Outcome.REFUSED, "stop"),
        "stop_3mb": Attack({**chat, "stop": ["x" * 3_000_000]}, Outcome.SERVED),
        "n_times_max_tokens": Attack({**chat, "n": 16, "max_tokens": 10**9}, Outcome.REFUSED, "messages"),
        "top_logprobs_1m": Attack({**chat, "logprobs": True, "top_logprobs": 10**6}, Outcome.REFUSED,
                                  "top_logprobs"),
        "messages_100k": Attack({**chat, "messages": [{"role": "user", "content": "hi"}] * 100_000},
                                Outcome.REFUSED, "messages"),
        "prompt_of_one_word": Attack({**chat, "messages": [{"role": "user", "content": "a" * 600_000}]},
                                     Outcome.REFUSED, "messages"),
        "body_nested_deep": Attack({**chat, "messages": [{"role": "user", "content": DEEP}]}, Outcome.REFUSED,
                                   depth=100_000),
    }
