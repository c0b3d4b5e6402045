"""A spec as llguidance grammar text, and the parser limits every llguidance grammar is compiled under.

The grammar library is llguidance (why: docs/libraries.md). `grammar_text` is what coserve's engine
compiles against the tokenizer; `lark_text` is the same language as Lark, for vLLM's `guidance` backend,
which takes only Lark. Both are text transforms (microseconds); compiling is the expensive part, done by
`guarded_check` at admission and by the engine (`coserve.torch_engine.grammar`) with `parser_limits()`.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, cast

import llguidance

from coserve.contract.structured_output import JSON_LAYOUT, OutputFormat, StructuredOutput, StructuredOutputError

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions  # llguidance declares it in its stubs only

# llguidance's defaults, but for the lexer's states: each costs 1-2 kB, and 250k of them (the default)
# would let one grammar hold ~0.5 GB of an engine's memory. JSON schemas within `schema_limits` need
# a few thousand; a grammar that needs more ends its own request with `grammar_error`.
MAX_LEXER_STATES = 50_000

# The fixed JSON layout as the compiler's options: JSON_LAYOUT's keys and value types are JsonCompileOptions'
# (the contract, which imports no library, keeps it as a plain dict).
_LAYOUT_OVERRIDES = cast("JsonCompileOptions", JSON_LAYOUT)


def parser_limits() -> llguidance.LLParserLimits:
    """The limits every grammar is checked and compiled under (gateway and engine alike)."""
    return llguidance.LLParserLimits(max_lexer_states=MAX_LEXER_STATES)


def grammar_text(spec: StructuredOutput) -> str:
    """The llguidance grammar of `spec` (not compiled, not checked).

    Raises:
        StructuredOutputError: a JSON schema llguidance cannot even read.
    """
    if spec.format is OutputFormat.LARK:
        return llguidance.LLMatcher.grammar_from_lark(spec.schema_json)
    schema = spec.schema_json if spec.format is OutputFormat.JSON_SCHEMA else '{"type":"object"}'
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=_LAYOUT_OVERRIDES)
    except ValueError as error:  # not an object schema (e.g. `true`), or not JSON
        raise StructuredOutputError(f"invalid JSON schema: {error}") from None


def lark_text(spec: StructuredOutput) -> str:
    """The same language as Lark text (llguidance's dialect): a JSON spec becomes `start: %json {schema}`
    with the fixed layout in the schema's `x-guidance`, which is what `grammar_text`'s override does."""
    if spec.format is OutputFormat.LARK:
        return spec.schema_json
    schema: dict[str, Any] = (json.loads(spec.schema_json) if spec.format is OutputFormat.JSON_SCHEMA
                              else {"type": "object"})
    schema["x-guidance"] = {**schema.get("x-guidance", {}), **JSON_LAYOUT}
    return f"start: %json {json.dumps(schema, separators=(',', ':'))}\n"


def compile_error(spec: StructuredOutput) -> str | None:
    """Why llguidance cannot enforce `spec` (e.g. `Unimplemented keys: ["not"]`, a look-around in a
    `pattern`, an unsatisfiable `required` property), or None. Runs the library: call it in the check's
    worker process (`check_worker`), never where a blow-up would cost more than this one request."""
    try:
        grammar = grammar_text(spec)
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, limits=parser_limits())
    except StructuredOutputError as error:
        return str(error)
    except BaseException as error:  # noqa: BLE001 - see below
        # A Rust panic inside llguidance arrives as pyo3's PanicException, a BaseException (seen
        # while fuzzing: slicing an error message inside a multi-byte character). It says the library
        # cannot handle this schema: a refusal, never a 500. Interpreter exits still propagate.
        if isinstance(error, (KeyboardInterrupt, SystemExit, GeneratorExit)):
            raise
        return "unsupported JSON schema: the grammar library failed on it"
    if is_error:
        return f"unsupported or invalid JSON schema: {messages[0]}"
    return None
