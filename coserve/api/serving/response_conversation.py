"""The conversation a Responses request continues: its own input items as they are stored (each with an
id, text content as parts), the items `previous_response_id` replays from the tenant's store, and the chat
messages of the whole (`coserve.frontend.response_items`), checked as chat's tool history is.

A link of the chain that is no longer stored is a 404 naming `previous_response_id` that says why (deleted,
evicted from the tenant's full store, expired, or never stored). Replaying is bounded (`MAX_CHAIN_LINKS`,
`MAX_REPLAY_BYTES`, `MAX_INPUT_ITEMS` in all): past that the request is a 400.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import anyio

from coserve.api.protocol.base import ProtocolError
from coserve.api.protocol.responses import ResponseCreateRequest
from coserve.api.protocol.responses_items import MAX_INPUT_ITEMS
from coserve.api.protocol.responses_objects import new_id
from coserve.api.protocol.training_tools import check_tool_calls, check_tool_flow
from coserve.frontend.response_items import chat_messages
from coserve.store import MetadataStore
from coserve.store.responses import Gone, StoredResponse

MAX_CHAIN_LINKS = 1_000
MAX_REPLAY_BYTES = 16 * 2**20
_GONE = {"deleted": "was deleted", "evicted": "was evicted: the tenant's response store was full (see "
                                              "max_stored_responses and max_stored_response_bytes)",
         "expired": "has expired (see stored_response_ttl_s)",
         "not_stored": "was not stored: it did not fit in the tenant's response store"}
_ID_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}


def gone_message(response_id: str, why: str) -> str:
    """What a 404 says about a response of this tenant that is no longer stored."""
    return f"The response '{response_id}' {_GONE.get(why, 'is no longer stored')}."


def not_found(response_id: str, param: str | None = None, gone: Gone | None = None) -> ProtocolError:
    """404 for a response id: unknown (or another tenant's), or this tenant's and no longer stored."""
    if gone is not None:
        return ProtocolError.not_found(gone_message(gone.id, gone.removed), param=param, code="response_not_found")
    return ProtocolError.not_found(f"No response found with id '{response_id}'.", param=param,
                                   code="response_not_found")


def stored_items(request: ResponseCreateRequest) -> list[dict[str, Any]]:
    """The request's input items as they are stored and listed: each with an `id`, a message's text as
    parts (`input_text`, an assistant's `output_text`)."""
    if isinstance(request.input, str):
        return [{"id": new_id("msg"), "type": "message", "role": "user", "status": "completed",
                 "content": [{"type": "input_text", "text": request.input}]}]
    items = []
    for item in request.input:
        data = item.model_dump(mode="json", exclude_none=True, by_alias=True)
        kind = data.setdefault("type", "message")
        data.setdefault("id", new_id(_ID_PREFIX[kind]))
        if kind == "message" and isinstance(data["content"], str):
            part = "output_text" if data["role"] == "assistant" else "input_text"
            data["content"] = [{"type": part, "text": data["content"],
                                **({"annotations": []} if part == "output_text" else {})}]
        items.append(data)
    return items


@dataclass(frozen=True, slots=True)
class Conversation:
    """What the model is given: the replayed items, then the request's own (`own`), as chat messages."""

    own: list[dict[str, Any]]
    messages: list[dict[str, Any]]


async def conversation(store: MetadataStore, tenant: str, request: ResponseCreateRequest,
                       ttl_s: int | None) -> Conversation:
    """The conversation of `request`: `previous_response_id`'s chain replayed (and kept alive: used now),
    then its own items; `instructions` first.

    Raises:
        ProtocolError: 404 naming `previous_response_id` (unknown, or no longer stored: the message says
            why), 400 naming `previous_response_id` (too long to replay) or `input` (tool calls and
            their outputs that do not fit together).
    """
    own = stored_items(request)
    history: list[dict[str, Any]] = []
    previous = request.previous_response_id
    if previous is not None:
        try:
            chain = await anyio.to_thread.run_sync(
                lambda: store.responses.chain(tenant, previous, MAX_CHAIN_LINKS, MAX_REPLAY_BYTES, ttl_s))
        except ValueError as error:
            raise ProtocolError(f"Invalid 'previous_response_id': {error}.", param="previous_response_id",
                                code="invalid_value") from None
        if not isinstance(chain, list):
            raise not_found(previous, "previous_response_id", chain)
        history = _replayed(chain)
    if len(history) + len(own) > MAX_INPUT_ITEMS:
        raise ProtocolError(f"Invalid 'input': the conversation holds more than {MAX_INPUT_ITEMS} items "
                            "(those of 'previous_response_id' included).", param="input", code="invalid_value")
    messages = chat_messages([*history, *own], request.instructions)
    _check_calls(messages)
    return Conversation(own, messages)


def _replayed(chain: list[StoredResponse]) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    for link in chain:
        if link.status in ("queued", "in_progress"):
            raise ProtocolError(f"The response '{link.id}' is still running: continue it once it is done.",
                                param="previous_response_id", code="response_in_progress")
        items.extend(link.input_items)
        items.extend(link.body.get("output", []))
    return items


def _check_calls(messages: list[dict[str, Any]]) -> None:
    """Function calls and their outputs fit together as chat's `tool_calls` and `tool` messages must."""
    for number, message in enumerate(messages, start=1):
        if message.get("tool_calls"):
            problem = check_tool_calls(message["tool_calls"], number)
            if problem is not None:
                raise ProtocolError(f"Invalid function call in the conversation: {problem}.", param="input",
                                    code="invalid_value")
    if any(m["role"] == "tool" or m.get("tool_calls") for m in messages):
        problem = check_tool_flow(messages, None, parallel=True)
        if problem is not None:
            raise ProtocolError(f"Invalid function calls in the conversation ('previous_response_id''s items "
                                f"included): {problem}. Each 'function_call' needs its 'function_call_output' "
                                "(same 'call_id') before the next message.", param="input", code="invalid_value")
