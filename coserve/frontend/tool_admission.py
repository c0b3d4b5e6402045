"""Admitting a chat request with tools: what the model's chat template can do with them, probed once.

Tools reach a model only through its chat template, so the scheduler (which holds the tokenizer)
decides, once at start:

* whether the template renders tool calls and tool results (`chat_render.require_tool_support`, the
  probe that guards fine-tuning data): if not, a conversation holding them is a 400 naming `messages`
  (its calls would silently vanish from the prompt);
* whether it renders a `tools` list: if not, `tool_choice` `auto` or `none` is a 400 naming `tools`
  (the model would never see them), while `required` or a named function are served with the tools
  described in a system message and the call forced in the format it describes
  (`coserve.tools.system_prompt`);
* the template's tool-call family (`template_family`, `coserve.tools.family`): needed to read calls
  back (`auto`), to force them with a grammar (`required`, a named function, else a 400 naming
  `tool_choice`) and to write the conversation's call ids as the template takes them; with `auto` and a
  structured output the grammar lets the reply be calls or that output (`calls_or_output_grammar`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from coserve.contract.messages import Rejection
from coserve.contract.sampling import SamplingParams
from coserve.frontend.chat_render import TemplateError, require_tool_support, template_messages
from coserve.frontend.messages import ChatSubmission
from coserve.frontend.template_family import template_family
from coserve.tools.call_grammar import calls_or_output_grammar, tool_call_grammar
from coserve.tools.call_ids import keep_id
from coserve.tools.family import ToolFamily
from coserve.tools.spec import ToolChoiceMode, ToolSpec
from coserve.tools.system_prompt import DESCRIBED_FAMILY, with_tools_described

_FORMATS = ("hermes '<tool_call>' JSON (Hermes, Qwen2.5, Qwen3), Llama 3.x JSON, Mistral '[TOOL_CALLS]'")
_NO_TOOLS = ("This model's chat template does not render tools, so with 'tool_choice' 'auto' or 'none' the "
             "model would never see them. Use 'tool_choice' 'required' or name a function: the tools are "
             "then described in a system message and the call is forced by a grammar. Templates that "
             f"render tools use one of the tool-call formats coserve reads: {_FORMATS}.")
_NO_CALLS = ("This model's chat template does not render tool calls or tool results, so 'messages' "
             "cannot contain assistant 'tool_calls' or 'tool' messages (they would vanish from the prompt).")
_NO_FAMILY = ("'tool_choice' {choice} needs a model whose tool-call format coserve knows ("
              + _FORMATS + "); this model's template writes another one. Use 'auto' or 'none'.")


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


def _choice(spec: ToolSpec) -> str:
    return "'required'" if spec.mode is ToolChoiceMode.REQUIRED else "naming a function"


def _forced(family: ToolFamily, spec: ToolSpec, sampling: SamplingParams) -> SamplingParams | Rejection:
    """`sampling` with the grammar that forces `spec`'s calls in `family`'s format, or the 400."""
    try:
        return replace(sampling, structured_output=tool_call_grammar(family, spec))
    except ValueError as error:  # the grammar's check, or ignore_eos / min_tokens with it
        return Rejection(400, f"'tool_choice' {_choice(spec)} cannot be enforced: {error}",
                         param="tool_choice", code="invalid_value")


class ToolSupport:
    """The chat template's tool abilities (probed at construction) and the admission rules above.

    Args:
        tokenizer: the served model's Hugging Face tokenizer, with its chat template.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.renders_calls = _renders(tokenizer, with_tools=False)
        self.renders_tools = self.renders_calls and _renders(tokenizer, with_tools=True)
        self.family = template_family(tokenizer) if self.renders_tools else None

    def prepare(self, sub: ChatSubmission) -> PreparedChat | Rejection:
        """The submission as it is rendered and sampled, or why it is refused (400)."""
        has_calls = any(m.get("role") == "tool" or m.get("tool_calls") for m in sub.messages)
        if has_calls and not self.renders_calls:
            return Rejection(400, _NO_CALLS, param="messages", code="invalid_value")
        call_id = keep_id if self.family is None else self.family.call_id
        messages = template_messages(sub.messages, call_id) if has_calls else sub.messages
        spec = sub.tools
        if spec is None:
            return PreparedChat(messages, None, sub.sampling, None)
        if not self.renders_tools:
            return _described(messages, spec, sub.sampling)
        sampling = sub.sampling
        if spec.mode is ToolChoiceMode.AUTO and sampling.structured_output is not None and self.family is not None:
            return self._calls_or_output(messages, spec, sampling, self.family)
        if spec.constrained:
            if self.family is None:
                return Rejection(400, _NO_FAMILY.format(choice=_choice(spec)), param="tool_choice",
                                 code="invalid_value")
            forced = _forced(self.family, spec, sub.sampling)
            if isinstance(forced, Rejection):
                return forced
            sampling = forced
        family = None if spec.mode is ToolChoiceMode.NONE else self.family
        return PreparedChat(messages, spec.tools, sampling, family)

    @staticmethod
    def _calls_or_output(messages: list[dict[str, Any]], spec: ToolSpec, sampling: SamplingParams,
                         family: ToolFamily) -> PreparedChat | Rejection:
        """`auto` with a structured output: the reply is calls or that output (`calls_or_output_grammar`)."""
        both = _calls_or_output_sampling(family, spec, sampling)
        if isinstance(both, Rejection):
            return both
        return PreparedChat(messages, spec.tools, both, family)


def _calls_or_output_sampling(family: ToolFamily, spec: ToolSpec,
                              sampling: SamplingParams) -> SamplingParams | Rejection:
    assert sampling.structured_output is not None
    try:
        return replace(sampling, structured_output=calls_or_output_grammar(family, spec, sampling.structured_output))
    except ValueError as error:
        return Rejection(400, f"'tools' with a structured output cannot be enforced: {error}", param="tools",
                         code="invalid_value")


def _described(messages: list[dict[str, Any]], spec: ToolSpec, sampling: SamplingParams) -> PreparedChat | Rejection:
    """A template that renders no tools: a forced call with the tools in the system message, or the 400."""
    if not spec.constrained:
        return Rejection(400, _NO_TOOLS, param="tools", code="invalid_value")
    forced = _forced(DESCRIBED_FAMILY, spec, sampling)
    if isinstance(forced, Rejection):
        return forced
    return PreparedChat(with_tools_described(messages, spec.tools), None, forced, DESCRIBED_FAMILY)
