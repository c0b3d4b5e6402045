"""A response's output, built from the generated text, and the stream events that build it.

`ResponseBuilder` takes one generation's text deltas (`OutputDelta`s), reads tool calls out of them with
the model's tool-call family (`ToolFamily.new_parser`, as chat's replies), and keeps the `response`
object's output items up to date: text becomes an assistant `message` item with one `output_text` part,
each call a `function_call` item (never text). Every change is also a stream event, in the order the
official client's `responses.stream()` checks (`openai.lib.streaming.responses`):

    response.created, response.in_progress (response.queued first for a background response)
    per item: response.output_item.added
        message:  content_part.added, output_text.delta*, output_text.done, content_part.done
        call:     function_call_arguments.delta, function_call_arguments.done
    response.output_item.done
    response.completed | response.incomplete | response.failed   (the whole response, usage included)

each with a `sequence_number` that rises by one. A non-streamed response is built the same way and its
events dropped, so both answers are the same response.
"""

from __future__ import annotations

import json
import time
from typing import Any

from coserve.api.protocol.responses_objects import (
    FunctionCall,
    IncompleteDetails,
    Logprob,
    OutputMessage,
    OutputTextPart,
    ResponseError,
    ResponseObject,
    ResponseStatus,
    ResponseUsage,
    TopLogprob,
    new_id,
)
from coserve.frontend.messages import LogprobEntry, OutputDelta
from coserve.tools.family import ToolFamily
from coserve.tools.parser import ParsedCall


def sse(event: dict[str, Any]) -> str:
    """One event as Server-Sent Events text (OpenAI's: an `event:` line, then the JSON)."""
    return f"event: {event['type']}\ndata: {json.dumps(event, separators=(',', ':'))}\n\n"


def _logprob(entry: LogprobEntry) -> Logprob:
    return Logprob(token=entry.token, logprob=entry.logprob, bytes=list(entry.token.encode()),
                   top_logprobs=[TopLogprob(token=t, logprob=lp, bytes=list(t.encode())) for t, lp in entry.top])


class ResponseBuilder:
    """The output of one response and its events.

    Args:
        response: the response object (status `in_progress` or `queued`, no output yet); updated in place.
        family: the tool-call format to read calls with (None: the reply is text).
        logprobs: put the tokens' logprobs on the `output_text` part and its deltas.
    """

    def __init__(self, response: ResponseObject, family: ToolFamily | None, logprobs: bool) -> None:
        self.response = response
        self._parser = None if family is None else family.new_parser()
        self._logprobs = logprobs
        self._message: OutputMessage | None = None
        self._sequence = 0
        self.events: list[dict[str, Any]] = []  # every event so far (a background response's stream replays them)

    def _emit(self, kind: str, **fields: Any) -> None:
        self.events.append({"type": kind, "sequence_number": self._sequence, **fields})
        self._sequence += 1

    def _snapshot(self) -> dict[str, Any]:
        return self.response.model_dump(mode="json")

    def start(self) -> None:
        """The opening events: `response.created`, then `queued` or `in_progress` as the status says."""
        self._emit("response.created", response=self._snapshot())
        self._emit(f"response.{self.response.status}", response=self._snapshot())

    def running(self) -> None:
        """A queued (background) response started: `response.in_progress`."""
        if self.response.status == "queued":
            self.response.status = "in_progress"
            self._emit("response.in_progress", response=self._snapshot())

    def feed(self, delta: OutputDelta) -> None:
        """One batch of the reply's text (and its logprobs)."""
        self.running()
        entries = [_logprob(e) for e in delta.logprobs or ()] if self._logprobs else None
        if self._parser is None:
            if delta.text or entries:
                self._text(delta.text, entries)
            return
        content, calls = self._parser.feed(delta.text)
        if delta.finish_reason is not None:
            content += self._parser.finish()
        if content:
            self._text(content, None)
        for call in calls:
            self._call(call)

    def _text(self, text: str, logprobs: list[Logprob] | None) -> None:
        message = self._message or self._open_message()
        part = message.content[0]
        part.text += text
        if logprobs is not None:
            part.logprobs = [*(part.logprobs or []), *logprobs]
        self._emit("response.output_text.delta", item_id=message.id, output_index=self._index(message),
                   content_index=0, delta=text, logprobs=[lp.model_dump(mode="json") for lp in logprobs or ()])

    def _index(self, item: OutputMessage | FunctionCall) -> int:
        return next(i for i, out in enumerate(self.response.output) if out is item)

    def _open_message(self, item_id: str | None = None) -> OutputMessage:
        message = OutputMessage(id=item_id or new_id("msg"))
        self.response.output.append(message)
        self._emit("response.output_item.added", output_index=self._index(message),
                   item=message.model_dump(mode="json"))
        message.content.append(OutputTextPart(logprobs=[] if self._logprobs else None))
        self._emit("response.content_part.added", item_id=message.id, output_index=self._index(message),
                   content_index=0, part=message.content[0].model_dump(mode="json"))
        self._message = message
        return message

    def _close_message(self, status: str) -> None:
        message, self._message = self._message, None
        if message is None:
            return
        index, part = self._index(message), message.content[0]
        message.status = "completed" if status == "completed" else "incomplete"
        self._emit("response.output_text.done", item_id=message.id, output_index=index, content_index=0,
                   text=part.text, logprobs=[lp.model_dump(mode="json") for lp in part.logprobs or ()])
        self._emit("response.content_part.done", item_id=message.id, output_index=index, content_index=0,
                   part=part.model_dump(mode="json"))
        self._emit("response.output_item.done", output_index=index, item=message.model_dump(mode="json"))

    def _call(self, call: ParsedCall, item_id: str | None = None) -> None:
        self._close_message("completed")
        item = FunctionCall(id=item_id or new_id("fc"), call_id=call.id, name=call.name)
        self.response.output.append(item)
        index = self._index(item)
        self._emit("response.output_item.added", output_index=index, item=item.model_dump(mode="json"))
        item.arguments = call.arguments
        self._emit("response.function_call_arguments.delta", item_id=item.id, output_index=index,
                   delta=call.arguments)
        self._emit("response.function_call_arguments.done", item_id=item.id, output_index=index, name=call.name,
                   arguments=call.arguments)
        item.status = "completed"
        self._emit("response.output_item.done", output_index=index, item=item.model_dump(mode="json"))

    def finish(self, finish_reason: str | None, usage: ResponseUsage) -> None:
        """The reply ended: close the open item, set the status (`incomplete` at the output limit) and
        usage, and emit the closing event with the whole response."""
        if self._parser is not None:
            rest = self._parser.finish()
            if rest:
                self._text(rest, None)
        status: ResponseStatus = "incomplete" if finish_reason == "length" else "completed"
        if not self.response.output:
            self._open_message()  # every reply has an item, an empty text included
        self._close_message(status)
        if status == "incomplete":
            self.response.incomplete_details = IncompleteDetails(reason="max_output_tokens")
        if finish_reason == "grammar_error":
            self._end("failed", usage, ResponseError(
                code="server_error", message="The output could not go on under 'text.format' or the forced tool "
                                             "call's grammar (a limit of the grammar library was hit)."))
            return
        self._end(status, usage, None)

    def fail(self, message: str, usage: ResponseUsage | None = None) -> None:
        """Generation failed after the response started: `response.failed` with the error."""
        self._close_message("incomplete")
        self._end("failed", usage, ResponseError(code="server_error", message=message))

    def cancel(self, usage: ResponseUsage | None = None) -> None:
        """A background response was cancelled: its items end incomplete, status `cancelled`; its stream
        ends with an `error` event (OpenAI's stream has no cancelled event)."""
        self._close_message("incomplete")
        self.response.status = "cancelled"
        self.response.usage = usage
        self._emit("error", code="response_cancelled", message="The response was cancelled.", param=None)

    def _end(self, status: ResponseStatus, usage: ResponseUsage | None, error: ResponseError | None) -> None:
        self.response.status = status
        self.response.usage = usage
        self.response.error = error
        self.response.completed_at = time.time() if status == "completed" else None
        self._emit(f"response.{status}", response=self._snapshot())


def replay(response: ResponseObject) -> list[dict[str, Any]]:
    """The events of a finished response, rebuilt from the stored object (each item's text in one delta):
    what a background response's stream resumed after its live events were let go sends."""
    start = response.model_copy(deep=True, update={
        "output": [], "status": "queued" if response.background else "in_progress", "usage": None, "error": None,
        "incomplete_details": None, "completed_at": None})
    builder = ResponseBuilder(start, None, logprobs=False)
    builder.start()
    builder.running()
    for item in response.output:
        if isinstance(item, FunctionCall):
            builder._call(ParsedCall(item.call_id, item.name, item.arguments), item.id)
            continue
        message = builder._open_message(item.id)
        part = item.content[0] if item.content else OutputTextPart()
        message.content[0] = part.model_copy(update={"text": "", "logprobs": None if part.logprobs is None else []})
        builder._text(part.text, part.logprobs)
        builder._close_message(item.status)
    if response.status == "cancelled":
        builder.cancel(response.usage)
    else:
        builder.response.incomplete_details = response.incomplete_details
        builder._end(response.status, response.usage, response.error)
    return builder.events
