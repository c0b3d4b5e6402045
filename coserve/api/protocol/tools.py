"""Tools on `POST /v1/chat/completions`: `tools`, `tool_choice`, `parallel_tool_calls`, and the calls
of a reply (`message.tool_calls`, streamed as `delta.tool_calls`).

Reference: https://platform.openai.com/docs/guides/function-calling. A tool's shape is checked by the
same code that checks fine-tuning rows (`training_tools.check_tools`: type `function`, a name of 1 to
64 letters, digits, `_` or `-`, unique names, at most `MAX_TOOLS` (OpenAI's 128)); an unknown key is
OpenAI's `Unrecognized request argument supplied` naming its path (`tools[0].function.x`); its
`parameters` must be an object schema within the sizes of `contract.schema_limits`, which the grammar
library can enforce (checked at admission, `frontend.intake`: the arguments of a `required` or named
call are generated under it). `tool_choice` and `parallel_tool_calls` need `tools`; a named function
must be one of them.
Whether the model can take tools at all depends on its chat template: the scheduler decides that
(`coserve.frontend.tool_admission`).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import model_serializer

from coserve.api.protocol.base import OpenAIBaseModel, nested_param, param_error, unknown_param_error
from coserve.api.protocol.strict import RequestModel
from coserve.api.protocol.training_tools import check_tools, unknown_tool_key
from coserve.contract.structured_output import StructuredOutput, StructuredOutputError
from coserve.tools.spec import ToolChoiceMode, ToolSpec


class NamedFunction(RequestModel):
    """The function a named `tool_choice` forces."""

    name: str


class NamedToolChoice(RequestModel):
    """`{"type": "function", "function": {"name": ...}}`: the reply is a call of that function."""

    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


def check_tool_request(tools: list[dict[str, Any]] | None, tool_choice: ToolChoice | None,
                       parallel: bool | None) -> ToolSpec | None:
    """The request's `ToolSpec` (None without tools).

    Raises:
        PydanticCustomError: a 400 naming `tools`, `tools[i].function.parameters`, `tool_choice` or
            `parallel_tool_calls`; an unknown key is OpenAI's 400 naming its path (`tools[0].function.x`).
    """
    if tools is None:
        for name, value in (("tool_choice", tool_choice), ("parallel_tool_calls", parallel)):
            if value is not None:
                raise param_error(name, f"'{name}' is only allowed when 'tools' are specified")
        return None
    unknown = unknown_tool_key(tools)
    if unknown is not None:
        raise unknown_param_error(unknown)
    problem = check_tools(tools)
    if problem is not None:
        raise param_error("tools", problem)
    for index, tool in enumerate(tools):
        _check_parameters(tool["function"].get("parameters"), f"tools[{index}].function.parameters")
    if isinstance(tool_choice, NamedToolChoice):
        name = tool_choice.function.name
        if name not in {tool["function"]["name"] for tool in tools}:
            raise param_error("tool_choice", f"'tool_choice' names the function {name!r}, which is not in "
                                             "'tools'")
        return ToolSpec(tools, ToolChoiceMode.FUNCTION, name, parallel is not False)
    mode = ToolChoiceMode(tool_choice or "auto")
    return ToolSpec(tools, mode, None, parallel is not False)


def _check_parameters(parameters: dict[str, Any] | None, param: str) -> None:
    if parameters is None:
        return
    if parameters.get("type", "object") != "object":
        raise param_error(param, "a function's 'parameters' must be a JSON Schema of type 'object' (the "
                                 "arguments are a JSON object)")
    try:
        StructuredOutput.json_schema(parameters)  # its sizes; what llguidance makes of it: at admission
    except StructuredOutputError as error:
        raise param_error(nested_param(param, error.path), str(error)) from None


def _without_none(handler: Any, model: OpenAIBaseModel) -> dict[str, Any]:
    # A streamed tool-call delta carries only what it adds: the official client's accumulator would
    # overwrite a call's `type` (and fail on its `id`) with an explicit null.
    return {key: value for key, value in handler(model).items() if value is not None}


class FunctionCall(OpenAIBaseModel):
    """The function a call invokes and its arguments, a JSON object written as a string."""

    name: str
    arguments: str


class ChatCompletionMessageToolCall(OpenAIBaseModel):
    """One call in `message.tool_calls`."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChoiceDeltaToolCallFunction(OpenAIBaseModel):
    """A piece of a streamed call's function: the name once, then pieces of the arguments."""

    name: str | None = None
    arguments: str | None = None

    @model_serializer(mode="wrap")
    def _serialize(self, handler: Any) -> dict[str, Any]:
        return _without_none(handler, self)


class ChoiceDeltaToolCall(OpenAIBaseModel):
    """A piece of a streamed call: its `index` in the reply, then `id` and `type` in its first piece."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: ChoiceDeltaToolCallFunction | None = None

    @model_serializer(mode="wrap")
    def _serialize(self, handler: Any) -> dict[str, Any]:
        return _without_none(handler, self)
