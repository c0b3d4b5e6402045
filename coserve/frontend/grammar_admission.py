"""Admitting a request's grammars: can llguidance enforce them? Asked off the event loop, under a budget.

A chat request may carry three grammars: its `response_format`, each tool's `parameters` (refused
when they cannot be enforced, as OpenAI refuses an invalid function schema), and the grammar that
forces a `required` or named call (all the functions' schemas in one Lark grammar). Their sizes were
bounded when they were read (`contract.schema_limits`); here `structured.guarded_check` compiles each
in a worker process under a memory and time budget, in a thread, so that a slow or hostile grammar
costs its sender a 400 and nobody else anything.
"""

from __future__ import annotations

from coserve.contract.messages import Rejection
from coserve.contract.structured_output import OutputFormat, StructuredOutput, StructuredOutputError
from coserve.frontend.messages import ChatSubmission
from coserve.frontend.tool_admission import PreparedChat
from coserve.structured.guarded_check import GrammarCheck


def grammars_to_check(sub: ChatSubmission, prepared: PreparedChat) -> list[tuple[str, StructuredOutput]]:
    """(the param a refusal names, the spec) for every grammar of the request, in the order refused."""
    specs: list[tuple[str, StructuredOutput]] = []
    requested = sub.sampling.structured_output
    if requested is not None:
        schema = requested.format is OutputFormat.JSON_SCHEMA
        specs.append(("response_format.json_schema.schema" if schema else "response_format", requested))
    for index, tool in enumerate(sub.tools.tools if sub.tools is not None else []):
        parameters = tool["function"].get("parameters")
        if parameters is not None:  # bounded by the gateway already: this cannot raise
            specs.append((f"tools[{index}].function.parameters", StructuredOutput.json_schema(parameters)))
    forced = prepared.sampling.structured_output
    if forced is not None and forced is not requested:
        specs.append(("tool_choice", forced))
    return specs


async def grammar_rejection(check: GrammarCheck, sub: ChatSubmission, prepared: PreparedChat) -> Rejection | None:
    """The 400 for the first grammar llguidance cannot enforce (or that is over the check's budget)."""
    for param, spec in grammars_to_check(sub, prepared):
        try:
            await check.check_async(spec)
        except StructuredOutputError as error:
            message = str(error)
            if param == "tool_choice":
                message = f"the forced tool call cannot be enforced: {message}"
            return Rejection(400, message, param=param, code="invalid_value")
    return None
