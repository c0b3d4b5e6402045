"""What a chat request asks of tools: the declared functions, the choice, parallel calls.

A plain dataclass: it travels inside `ChatSubmission` from the gateway (which validated it) to the
scheduler (which renders the tools with the chat template and, for `required` or a named function,
turns them into a grammar).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any


class ToolChoiceMode(enum.Enum):
    """OpenAI's `tool_choice`: `none`, `auto`, `required`, or one named function."""

    NONE = "none"  # tools are shown to the model, no call is read back
    AUTO = "auto"  # the model generates freely; calls in its text are parsed out
    REQUIRED = "required"  # the output is one or more calls of the declared functions (grammar)
    FUNCTION = "function"  # the output is a call of `ToolSpec.function` (grammar)


@dataclass(slots=True)
class ToolSpec:
    """The tools of one request.

    Args:
        tools: the request's `tools`, OpenAI's shape (`{"type": "function", "function": {"name",
            "description"?, "parameters"?, "strict"?}}`), validated; the chat template renders them.
        mode: the tool choice.
        function: the function a FUNCTION choice names (one of `tools`).
        parallel: whether a reply may hold more than one call (`parallel_tool_calls`, default true).
    """

    tools: list[dict[str, Any]] = field(default_factory=list)
    mode: ToolChoiceMode = ToolChoiceMode.AUTO
    function: str | None = None
    parallel: bool = True

    @property
    def constrained(self) -> bool:
        """Whether the output must be calls (a grammar forces them)."""
        return self.mode in (ToolChoiceMode.REQUIRED, ToolChoiceMode.FUNCTION)

    def callable_functions(self) -> list[dict[str, Any]]:
        """The `function` objects a constrained reply may call: the named one, or all of them."""
        functions = [tool["function"] for tool in self.tools]
        if self.mode is ToolChoiceMode.FUNCTION:
            return [f for f in functions if f["name"] == self.function]
        return functions
