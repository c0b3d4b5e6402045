"""Replies of requests with tools: calls read out of the generated text (the family's parser,
`coserve.tools.family`) become `message.tool_calls`, or `delta.tool_calls` in a stream, with
`finish_reason: "tool_calls"`.

A streamed call is sent once it is complete (its close tag, or the bracket that closes its JSON: a
call that does not parse stays content, which only its end can tell): a first piece with the call's
`index`, `id`, `type` and function `name` and empty `arguments`, then a piece with the arguments, the
shape of OpenAI's streams, which the official client's stream helpers reassemble. The other text is
streamed as content as it comes, except what may still be the start of a call.
"""

from __future__ import annotations

from coserve.api.protocol.chat import (
    ChatCompletionChunkChoice,
    ChatCompletionMessage,
    ChoiceDelta,
    ChoiceLogprobs,
    FinishReason,
)
from coserve.api.protocol.tools import (
    ChatCompletionMessageToolCall,
    ChoiceDeltaToolCall,
    ChoiceDeltaToolCallFunction,
    FunctionCall,
)
from coserve.frontend.messages import OutputDelta
from coserve.tools.family import ToolFamily
from coserve.tools.parser import ParsedCall


def finish_with_calls(reason: FinishReason, has_calls: bool) -> FinishReason:
    """A reply that ended by itself after making calls finishes with `tool_calls` (OpenAI's)."""
    return "tool_calls" if has_calls and reason == "stop" else reason


def tool_message(text: str, family: ToolFamily) -> ChatCompletionMessage:
    """The assistant message of a whole reply: its calls, and the text around them as content."""
    parsed = family.parse(text)
    calls = [ChatCompletionMessageToolCall(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments))
             for c in parsed.calls]
    return ChatCompletionMessage(content=parsed.content, tool_calls=calls or None)


def _call_pieces(number: int, call: ParsedCall) -> list[ChoiceDeltaToolCall]:
    return [ChoiceDeltaToolCall(index=number, id=call.id, type="function",
                                function=ChoiceDeltaToolCallFunction(name=call.name, arguments="")),
            ChoiceDeltaToolCall(index=number, function=ChoiceDeltaToolCallFunction(arguments=call.arguments))]


class ToolStream:
    """Turns one streamed request's output deltas into chunk choices, one parser per choice."""

    def __init__(self, family: ToolFamily, n: int) -> None:
        self._parsers = [family.new_parser() for _ in range(n)]

    def choices(self, delta: OutputDelta, logprobs: ChoiceLogprobs | None,
                finish: FinishReason | None) -> list[ChatCompletionChunkChoice]:
        """The chunk choices for `delta` (none while its text is undecided): `logprobs` is the
        delta's rendered logprobs (sent with its first choice), `finish` its finish reason as the
        reply reports it (the choice's last chunk)."""
        parser = self._parsers[delta.index]
        before = len(parser.calls)
        content, calls = parser.feed(delta.text)
        if finish is not None:
            content += parser.finish()
        out: list[ChatCompletionChunkChoice] = []
        if content or logprobs is not None:
            out.append(ChatCompletionChunkChoice(index=delta.index, delta=ChoiceDelta(content=content or None),
                                                 logprobs=logprobs))
        for number, call in enumerate(calls, start=before):
            out.extend(ChatCompletionChunkChoice(index=delta.index, delta=ChoiceDelta(tool_calls=[piece]))
                       for piece in _call_pieces(number, call))
        if finish is not None:
            out.append(ChatCompletionChunkChoice(index=delta.index, delta=ChoiceDelta(),
                                                 finish_reason=finish_with_calls(finish, bool(parser.calls))))
        return out
