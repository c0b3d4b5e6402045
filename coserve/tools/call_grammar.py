"""The grammar that forces tool calls: `tool_choice` `required` or a named function.

The output must be exactly the family's call text (`family.ToolFamily`), once, or with
`parallel_tool_calls` one to `MAX_PARALLEL_CALLS` times, each call naming a callable function and
carrying arguments valid against that function's JSON schema. It is a Lark grammar in llguidance's
dialect with each schema embedded by `%json`, so llguidance enforces it token by token like any
`response_format`, in the same fixed JSON layout (`structured_output.JSON_LAYOUT`). Once the calls are
complete only EOS is allowed.
"""

from __future__ import annotations

import json
from typing import Any

from coserve.contract.schema_limits import schemas_violation
from coserve.contract.structured_output import JSON_LAYOUT, StructuredOutput, StructuredOutputError
from coserve.tools.family import ToolFamily
from coserve.tools.spec import ToolSpec

# A bound on the calls of one reply under a grammar: an unbounded repetition lets a weak model emit
# calls until its token limit cuts the last one.
MAX_PARALLEL_CALLS = 8
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
    rules = []
    alternatives = []
    for index, function in enumerate(functions):
        schema = {**arguments_schema(function), "x-guidance": JSON_LAYOUT}
        head = '{"name": ' + json.dumps(function["name"]) + ', "arguments": '
        rules.append(f"fn_{index}: {_literal(head)} args_{index} {_literal('}')}")
        rules.append(f"args_{index}: %json {json.dumps(schema)}")
        alternatives.append(f"fn_{index}")
    call = f"call: {_literal(family.open)} ({' | '.join(alternatives)}) {_literal(family.close)}"
    if spec.parallel:
        start = f"start: call ({_literal(family.separator)} call){{0,{MAX_PARALLEL_CALLS - 1}}}"
    else:
        start = "start: call"
    return StructuredOutput.lark("\n".join([start, call, *rules]) + "\n")
