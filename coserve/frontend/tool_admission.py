"""Admitting a chat request with tools: what the model's chat template can do with them, probed once.

Tools reach a model only through its chat template, so the scheduler (which holds the tokenizer)
decides, once at start:

* whether the template renders tool calls and tool results (`chat_render.require_tool_support`, the
  probe that guards fine-tuning data): if not, a conversation holding them is a 400 naming `messages`
  (its calls would silently vanish from the prompt), and `tools` a 400 naming `tools`;
* the template's tool-call family (`coserve.tools.family`): needed to read calls back (`auto`) and to
  force them with a grammar (`required`, a named function, else a 400 naming `tool_choice`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from coserve.contract.messages import Rejection
from coserve.contract.sampling import SamplingParams
from coserve.frontend.chat_render import TemplateError, require_tool_support, template_messages
from coserve.frontend.messages import ChatSubmission
from coserve.tools.call_grammar import tool_call_grammar
from coserve.tools.family import ToolFamily, detect_family, template_text
from coserve.tools.spec import ToolChoiceMode

_NO_TOOLS = ("This model's chat template does not render tools, so the model cannot be given 'tools' "
             "(it would never see them). Tools work on models whose template does, such as Qwen2.5, "
             "Qwen3 or Hermes (the tool-call format coserve reads is '<tool_call>' JSON).")
_NO_CALLS = ("This model's chat template does not render tool calls or tool results, so 'messages' "
             "cannot contain assistant 'tool_calls' or 'tool' messages (they would vanish from the prompt).")
_NO_FAMILY = ("'tool_choice' {choice} needs a model whose tool-call format coserve knows (the "
              "'<tool_call>' JSON of Hermes, Qwen2.5 and Qwen3 templates); this model's template writes "
              "another one. Use 'auto' or 'none'.")


@dataclass(slots=True)
class PreparedChat:
    """A submission ready to render: messages as templates take them, the tools to show, the sampling
    (with the call grammar when one is forced), and the family to read calls with (or None)."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    sampling: SamplingParams
    family: ToolFamily | None


def _renders(tokenizer: Any, with_tools: bool) -> bool:
    try:
        require_tool_support(tokenizer, with_tools=with_tools)
    except TemplateError:
        return False
    return True


class ToolSupport:
    """The chat template's tool abilities (probed at construction) and the admission rules above.

    Args:
        tokenizer: the served model's Hugging Face tokenizer, with its chat template.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.renders_calls = _renders(tokenizer, with_tools=False)
        self.renders_tools = self.renders_calls and _renders(tokenizer, with_tools=True)
        self.family = detect_family(template_text(tokenizer)) if self.renders_tools else None

    def prepare(self, sub: ChatSubmission) -> PreparedChat | Rejection:
        """The submission as it is rendered and sampled, or why it is refused (400)."""
        has_calls = any(m.get("role") == "tool" or m.get("tool_calls") for m in sub.messages)
        if has_calls and not self.renders_calls:
            return Rejection(400, _NO_CALLS, param="messages", code="invalid_value")
        messages = template_messages(sub.messages) if has_calls else sub.messages
        spec = sub.tools
        if spec is None:
            return PreparedChat(messages, None, sub.sampling, None)
        if not self.renders_tools:
            return Rejection(400, _NO_TOOLS, param="tools", code="invalid_value")
        sampling = sub.sampling
        if spec.constrained:
            choice = "'required'" if spec.mode is ToolChoiceMode.REQUIRED else "naming a function"
            if self.family is None:
                return Rejection(400, _NO_FAMILY.format(choice=choice), param="tool_choice", code="invalid_value")
            try:
                sampling = replace(sampling, structured_output=tool_call_grammar(self.family, spec))
            except ValueError as error:  # the grammar's check, or ignore_eos / min_tokens with it
                return Rejection(400, f"'tool_choice' {choice} cannot be enforced: {error}",
                                 param="tool_choice", code="invalid_value")
        family = None if spec.mode is ToolChoiceMode.NONE else self.family
        return PreparedChat(messages, spec.tools, sampling, family)
