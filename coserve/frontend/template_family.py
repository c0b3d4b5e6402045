"""Which tool-call family (`coserve.tools.family`) a chat template writes, found by rendering a call.

The probe conversation (`chat_render.probe_conversation`: a user message, then an assistant message
calling a probe function) is rendered whole and up to the generation prompt; what the whole rendering
adds after their common start is the assistant turn the template writes for the call, and the family
is the one whose parser reads that call back out of it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from coserve.frontend.chat_render import PROBE_ARGUMENTS, PROBE_TOOL, TemplateError, probe_conversation, render
from coserve.tools.call_ids import keep_id
from coserve.tools.family import ToolFamily, detect_family


def probe_call_turn(tokenizer: Any) -> str | None:
    """The assistant turn the chat template writes for the probe call; None when it cannot render it."""
    conversation = probe_conversation()
    try:
        whole = render(tokenizer, conversation, generation_prompt=False)
        prompt = render(tokenizer, conversation[:1], generation_prompt=True)
    except TemplateError:
        return None
    return whole[len(os.path.commonprefix([whole, prompt])):]


def template_family(tokenizer: Any) -> ToolFamily | None:
    """The tool-call family of the tokenizer's chat template, or None (none known, or no template)."""
    return detect_family(probe_call_turn(tokenizer), PROBE_TOOL, PROBE_ARGUMENTS)


def call_id_rule(tokenizer: Any, messages: Sequence[Mapping[str, Any]]) -> Callable[[str], str]:
    """How the template takes the call ids of `messages`: its family's rule when they hold tool calls
    or results, as given otherwise (and on a template of no known family)."""
    if not any(m.get("tool_calls") or m.get("role") == "tool" for m in messages):
        return keep_id
    family = template_family(tokenizer)
    return keep_id if family is None else family.call_id
