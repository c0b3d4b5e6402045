"""The grammar that forces tool calls: `tool_choice` `required` or a named function.

The output must be exactly the family's call text (`family.ToolFamily.layout`, `call_layout.CallLayout`),
one call, or with `parallel_tool_calls` one to the layout's `max_calls` calls, each call naming a
callable function and carrying arguments valid against that function's JSON schema. It is a Lark
grammar in llguidance's dialect with each schema embedded by `%json`, so llguidance enforces it token
by token like any `response_format`, in the same fixed JSON layout (`structured_output.JSON_LAYOUT`).
Once the calls are complete only EOS is allowed.

`tool_choice` `auto` with a structured output (chat's `response_format`, the Responses API's `text.format`:
the Agents SDK's `output_type` beside its tools) is the union: calls as above, or the output asked for
(`calls_or_output_grammar`).
"""

from __future__ import annotations

import json
from typing import Any

from coserve.contract.schema_limits import schemas_violation
from coserve.contract.structured_output import JSON_LAYOUT, OutputFormat, StructuredOutput, StructuredOutputError
from coserve.tools.call_layout import MAX_PARALLEL_CALLS, CallLayout
from coserve.tools.family import ToolFamily
from coserve.tools.spec import ToolChoiceMode, ToolSpec

__all__ = ["MAX_PARALLEL_CALLS", "arguments_schema", "calls_or_output_grammar", "tool_call_grammar"]

# OpenAI: "Omitting parameters defines a function with an empty parameter list."
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}


def arguments_schema(function: dict[str, Any]) -> dict[str, Any]:
    """The JSON schema a call's arguments must follow."""
    parameters = function.get("parameters")
    return NO_PARAMETERS if parameters is None else parameters


def _literal(text: str) -> str:
    # A JSON string literal is a Lark string literal too (the same escapes).
    return json.dumps(text)


def tool_call_grammar(family: ToolFamily, spec: ToolSpec) -> StructuredOutput:
    """The grammar of a constrained reply (`spec.constrained`) in `family`'s format.

    Raises:
        ValueError: `spec` names no callable function.
        StructuredOutputError: the functions' schemas together are over a size limit (each one alone
            was bounded where the request was read; one grammar holds them all).
    """
    functions = spec.callable_functions()
    if not functions:
        raise ValueError("no function to call")
    over = schemas_violation([arguments_schema(function) for function in functions])
    if over is not None:
        raise StructuredOutputError(f"the functions' parameters together are too large: {over.message}")
    layout = family.layout
    rules = []
    alternatives = []
    for index, function in enumerate(functions):
        schema = {**arguments_schema(function), "x-guidance": JSON_LAYOUT}
        head = layout.call_open + '{"name": ' + json.dumps(function["name"]) + f', "{layout.arguments_key}": '
        rules.append(f"fn_{index}: {_literal(head)} args_{index} {_literal('}' + layout.call_close)}")
        rules.append(f"args_{index}: %json {json.dumps(schema)}")
        alternatives.append(f"fn_{index}")
    return StructuredOutput.lark("\n".join([_start(layout, spec.parallel), f"call: {' | '.join(alternatives)}",
                                            *rules]) + "\n")


def calls_or_output_grammar(family: ToolFamily, spec: ToolSpec, output: StructuredOutput) -> StructuredOutput:
    """`tool_choice` `auto` with a structured output (`response_format`, `text.format`): the reply is
    either calls, as a forced reply's (`tool_call_grammar`), or the output `output` asks for (a JSON object,
    or JSON valid against its schema). So a model may call the tools, or answer in the format asked for.

    Raises:
        ValueError, StructuredOutputError: as `tool_call_grammar`; a Lark `output` (only coserve writes one).
    """
    if output.format is OutputFormat.LARK:
        raise ValueError("a grammar cannot be combined with tool calls")
    schema: dict[str, Any] = {"type": "object"} if output.format is OutputFormat.JSON_OBJECT else \
        json.loads(output.schema_json)
    calls = tool_call_grammar(family, ToolSpec(spec.tools, ToolChoiceMode.REQUIRED, None, spec.parallel))
    grammar = calls.schema_json.replace("start:", "calls:", 1)
    both = f"start: calls | output\noutput: %json {json.dumps({**schema, 'x-guidance': JSON_LAYOUT})}\n{grammar}"
    return StructuredOutput.lark(both)


def _start(layout: CallLayout, parallel: bool) -> str:
    """The start rule: the calls between `before` and `after`."""
    calls = "call"
    if parallel and layout.max_calls > 1:
        calls = f"call ({_literal(layout.separator)} call){{0,{layout.max_calls - 1}}}"
    before = f"{_literal(layout.before)} " if layout.before else ""
    after = f" {_literal(layout.after)}" if layout.after else ""
    return f"start: {before}{calls}{after}"
