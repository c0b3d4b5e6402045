"""Structured output: the grammar a request's output must follow, as a plain value, bounded when made.

A `StructuredOutput` travels on `SamplingParams` (so across processes, inside `NewSequence`): it is a
frozen dataclass of an enum and a string, nothing compiled. Its constructors refuse a schema or grammar
over the sizes of `schema_limits`, in pure Python, so no spec that could make the grammar library
allocate without bound exists anywhere. Whether the grammar library can enforce a spec (JSON Schema
keywords it lacks, look-around in a `pattern`, ...) is checked where a request is made, by
`coserve.structured` under a memory and time budget; the engine compiles it with llguidance against
the model's tokenizer, once per distinct spec, and masks every sampled token with it.

JSON is generated in one fixed layout, `json.dumps`'s default (`", "` between items, `": "` after keys,
no newlines): a grammar that allows free whitespace lets a small model emit whitespace until its token
limit, and then the JSON never closes.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from typing import Any

from coserve.contract.schema_limits import Path, Violation, lark_violation, schema_text_violation, schema_violation

# llguidance's JSON compiler options (see its JsonCompileOptions): the one layout of generated JSON.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class OutputFormat(enum.Enum):
    """What the output must be: any JSON object, JSON that validates against a schema, or text that a
    Lark grammar (llguidance's dialect, JSON schemas embedded with `%json`) derives (tool calls)."""

    JSON_OBJECT = "json_object"
    JSON_SCHEMA = "json_schema"
    LARK = "lark"


class StructuredOutputError(ValueError):
    """The spec cannot be enforced: invalid JSON Schema, a feature the grammar library lacks, or a size
    over its limit (`path`: where in the schema, e.g. `("properties", "a", "maxItems")`)."""

    def __init__(self, message: str, path: Path = ()) -> None:
        super().__init__(message)
        self.path = path

    @classmethod
    def from_violation(cls, violation: Violation) -> StructuredOutputError:
        return cls(violation.message, violation.path)


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """The grammar of one request's output. Build it with `json_object()`, `json_schema(schema)` or
    `lark(grammar)`.

    Args:
        format: JSON_OBJECT, JSON_SCHEMA or LARK.
        schema_json: the JSON Schema as compact JSON text (key order kept: it is the order properties
            are generated in); empty for JSON_OBJECT; the Lark grammar's text for LARK. Equal schemas
            give equal specs, so the engine's cache of compiled grammars is keyed by the spec itself.
    """

    format: OutputFormat
    schema_json: str = ""

    @classmethod
    def json_object(cls) -> StructuredOutput:
        """Any JSON object (OpenAI's `response_format={"type": "json_object"}`)."""
        return cls(OutputFormat.JSON_OBJECT)

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | str) -> StructuredOutput:
        """JSON valid against `schema` (a dict or its JSON text).

        Raises:
            StructuredOutputError: `schema` is not a JSON object, or a size of it is over its limit.
        """
        if isinstance(schema, str):
            too_big = schema_text_violation(schema)
            if too_big is not None:
                raise StructuredOutputError.from_violation(too_big)
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as error:
                raise StructuredOutputError(f"the schema is not valid JSON: {error}") from None
            except RecursionError:
                raise StructuredOutputError("the schema is nested too deeply") from None
        if not isinstance(schema, dict):
            raise StructuredOutputError("the schema must be a JSON object")
        over = schema_violation(schema)  # before encoding it: the encoder recurses too
        if over is not None:
            raise StructuredOutputError.from_violation(over)
        text = json.dumps(schema, separators=(",", ":"))
        too_big = schema_text_violation(text)
        if too_big is not None:
            raise StructuredOutputError.from_violation(too_big)
        return cls(OutputFormat.JSON_SCHEMA, text)

    @classmethod
    def lark(cls, grammar: str) -> StructuredOutput:
        """Text derived by `grammar`, a Lark grammar in llguidance's dialect (its `start` rule is the
        whole output; `%json {...}` embeds a JSON schema, laid out as `json_object` is). Only coserve
        writes Lark (the forced tool call, `coserve.tools.call_grammar`), after bounding the schemas it embeds.

        Raises:
            StructuredOutputError: the grammar is over its size limit.
        """
        over = lark_violation(grammar)
        if over is not None:
            raise StructuredOutputError.from_violation(over)
        return cls(OutputFormat.LARK, grammar)
