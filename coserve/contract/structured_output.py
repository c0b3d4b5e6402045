"""Structured output: the grammar a request's output must follow, as a plain value, checked at admission.

A `StructuredOutput` travels on `SamplingParams` (so across processes, inside `NewSequence`): it is a
frozen dataclass of an enum and a string, nothing compiled. The engine (`coserve.platform.grammar`)
compiles it with llguidance against the model's tokenizer, once per distinct spec, and masks every
sampled token with it.

The check here runs where the request is made (the gateway's protocol model, `SamplingParams`), with the
same library the engine uses, so a schema the engine could not compile is refused with a clear message
before it is queued: an engine iteration never meets an invalid grammar. llguidance is a Rust library
with no torch dependency, which keeps this module torch-free like the rest of `coserve.policies`.

JSON is generated in one fixed layout, `json.dumps`'s default (`", "` between items, `": "` after keys,
no newlines): a grammar that allows free whitespace lets a small model emit whitespace until its token
limit, and then the JSON never closes.
"""

from __future__ import annotations

import enum
import functools
import json
import logging
from dataclasses import dataclass

logger = logging.getLogger(__name__)

# llguidance's JSON compiler options (see its JsonCompileOptions): the one layout of generated JSON.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# Distinct specs whose check (and grammar text) is remembered; each is a few KB.
_CHECK_CACHE_SIZE = 256
# Schemas larger than this are refused before compiling (bytes of canonical JSON).
MAX_SCHEMA_BYTES = 256 * 1024


class OutputFormat(enum.Enum):
    """What the output must be: any JSON object, JSON that validates against a schema, or text that a
    Lark grammar (llguidance's dialect, JSON schemas embedded with `%json`) derives (tool calls)."""

    JSON_OBJECT = "json_object"
    JSON_SCHEMA = "json_schema"
    LARK = "lark"


class StructuredOutputError(ValueError):
    """The spec cannot be enforced: invalid JSON Schema, or a feature the grammar library lacks."""


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
    def json_schema(cls, schema: dict | str) -> StructuredOutput:
        """JSON valid against `schema` (a dict or its JSON text).

        Raises:
            StructuredOutputError: `schema` is not a JSON object.
        """
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as error:
                raise StructuredOutputError(f"the schema is not valid JSON: {error}") from None
        if not isinstance(schema, dict):
            raise StructuredOutputError("the schema must be a JSON object")
        return cls(OutputFormat.JSON_SCHEMA, json.dumps(schema, separators=(",", ":")))

    @classmethod
    def lark(cls, grammar: str) -> StructuredOutput:
        """Text derived by `grammar`, a Lark grammar in llguidance's dialect (its `start` rule is the
        whole output; `%json {...}` embeds a JSON schema, laid out as `json_object` is)."""
        return cls(OutputFormat.LARK, grammar)

    def check(self) -> None:
        """Raise `StructuredOutputError` naming what cannot be enforced (e.g. `Unimplemented keys:
        ["not"]`, a look-around in a `pattern`, an unsatisfiable `required` property)."""
        _, error = _compile(self.format, self.schema_json)
        if error is not None:
            raise StructuredOutputError(error)

    def grammar(self) -> str:
        """The llguidance grammar text (what the engine compiles against the tokenizer).

        Raises:
            StructuredOutputError: as `check`.
        """
        grammar, error = _compile(self.format, self.schema_json)
        if error is not None:
            raise StructuredOutputError(error)
        return grammar

    def lark_grammar(self) -> str:
        """The same grammar as Lark text (llguidance's dialect), for an engine that takes only Lark
        (vLLM's `guidance` backend): a JSON spec becomes `start: %json {schema}` with the fixed layout
        in the schema's `x-guidance`, which is what `grammar()`'s layout override does.

        Raises:
            StructuredOutputError: as `check`.
        """
        self.check()
        if self.format is OutputFormat.LARK:
            return self.schema_json
        schema = json.loads(self.schema_json) if self.format is OutputFormat.JSON_SCHEMA else {"type": "object"}
        schema["x-guidance"] = {**schema.get("x-guidance", {}), **JSON_LAYOUT}
        return f"start: %json {json.dumps(schema, separators=(',', ':'))}\n"


@functools.lru_cache(maxsize=_CHECK_CACHE_SIZE)
def _compile(output_format: OutputFormat, schema_json: str) -> tuple[str, str | None]:
    """(grammar text, None) or ("", the reason it cannot be enforced)."""
    import llguidance

    if output_format is OutputFormat.JSON_OBJECT:
        schema_json = '{"type":"object"}'
    elif len(schema_json.encode()) > MAX_SCHEMA_BYTES:
        return "", f"the schema is larger than {MAX_SCHEMA_BYTES} bytes"
    try:
        if output_format is OutputFormat.LARK:
            grammar = llguidance.LLMatcher.grammar_from_lark(schema_json)
        else:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(schema_json, overrides=JSON_LAYOUT)
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    except ValueError as error:  # not an object schema (e.g. `true`), or not JSON
        return "", f"invalid JSON schema: {error}"
    except BaseException as error:  # noqa: BLE001 - see below
        # A Rust panic inside llguidance arrives as pyo3's PanicException, a BaseException (seen
        # while fuzzing: slicing an error message inside a multi-byte character). It says the library
        # cannot handle this schema: a refusal, never a 500. Interpreter exits still propagate.
        if isinstance(error, (KeyboardInterrupt, SystemExit, GeneratorExit)):
            raise
        logger.warning("llguidance failed on a schema: %r", error)
        return "", "unsupported JSON schema: the grammar library failed on it"
    if is_error:
        return "", f"unsupported or invalid JSON schema: {messages[0]}"
    return grammar, None
