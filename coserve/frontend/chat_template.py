"""Rendering a conversation with the model's chat template: `encode_chat` gives the prompt text and
token ids, `chat_template_refusal` says why in the client's terms when the template refuses it."""

from __future__ import annotations

from typing import Any

import jinja2


def encode_chat(tokenizer: Any, messages: list[dict[str, Any]], chat_template: str | None = None,
                add_generation_prompt: bool = True) -> tuple[str, list[int]]:
    """The conversation as prompt text and token ids (the template already holds any BOS).

    Raises:
        whatever the template raises for a conversation it does not accept (jinja2 errors,
        ValueError, TypeError): callers report it as a bad `messages` parameter.
    """
    text: str = tokenizer.apply_chat_template(messages, chat_template=chat_template, tokenize=False,
                                              add_generation_prompt=add_generation_prompt)
    ids: list[int] = tokenizer.encode(text, add_special_tokens=False)
    return text, ids


def chat_template_refusal(error: Exception) -> str:
    """What to tell a client whose messages `encode_chat` could not render.

    A template's own `raise_exception(...)` (jinja2's plain `TemplateError`) is written for users
    ("Conversation roles must alternate user/assistant/...") and is passed on. Anything else (a missing
    key or a type error inside the template, the tokenizer) would show the server's internals
    (`'dict object' has no attribute ...`), so it is described instead; the caller logs the details.
    """
    if type(error) is jinja2.exceptions.TemplateError:
        return f"The model's chat template does not accept these messages: {error}"
    return ("The model's chat template cannot render these messages: this model expects another "
            "conversation (check the roles, their order and the fields of each message).")
