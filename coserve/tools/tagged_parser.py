"""Calls between an open and a close tag, anywhere in the text: hermes's
`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`.

A block between the tags is a call when it holds a call object (`parser.read_call`); otherwise it stays
in the content as written, as does an open tag that is never closed. The newlines around the tags are
dropped with the call.
"""

from __future__ import annotations

from coserve.tools.parser import ParsedCall, prefix_overlap, read_call, run_steps


class TaggedCallParser:
    """A `parser.CallParser` for calls between `open_tag` and `close_tag`.

    `feed` returns what can be told apart so far; text that may still become a tag or the whitespace
    before one is held back until the next piece (or `finish`) decides it.
    """

    def __init__(self, open_tag: str, close_tag: str) -> None:
        self._open = open_tag
        self._close = close_tag
        self._pending = ""  # outside a call: undecided text; inside: the call's text so far
        self._inside = False
        self._scanned = 0  # inside: where in `_pending` the close tag may still start (no rescans)
        self._gap = ""  # the whitespace before the open tag: kept if the block is no call
        self._after_call = False  # whitespace right after a call is dropped
        self.calls: list[ParsedCall] = []

    def feed(self, text: str) -> tuple[str, list[ParsedCall]]:
        """Add generated text; returns (content that is now certain, calls completed by it)."""
        self._pending += text
        content, calls = run_steps(self._step)
        self.calls.extend(calls)
        return content, calls

    def _step(self, content: list[str], calls: list[ParsedCall]) -> bool:
        """Decide what `_pending` starts with; False when more text is needed."""
        if self._inside:
            return self._close_block(content, calls)
        if self._after_call:
            self._pending = self._pending.lstrip()
            if not self._pending:
                return False
            self._after_call = False
        start = self._pending.find(self._open)
        if start < 0:
            keep = prefix_overlap(self._pending, self._open)
            certain = self._pending[:len(self._pending) - keep]
            stripped = certain.rstrip()  # whitespace before a possible call waits too
            content.append(stripped)
            self._pending = self._pending[len(stripped):]
            return False
        before = self._pending[:start]
        content.append(before.rstrip())
        self._gap = before[len(before.rstrip()):]
        self._pending = self._pending[start + len(self._open):]
        self._inside = True
        return True

    def _close_block(self, content: list[str], calls: list[ParsedCall]) -> bool:
        end = self._pending.find(self._close, self._scanned)
        if end < 0:
            self._scanned = max(0, len(self._pending) - len(self._close) + 1)
            return False
        self._scanned = 0
        block, self._pending = self._pending[:end], self._pending[end + len(self._close):]
        self._inside = False
        call = read_call(block.strip())
        if call is None:  # not a call: the model's text, as written
            content.append(self._gap + self._open + block + self._close)
            self._after_call = False
        else:
            calls.append(call)
            self._after_call = True
        return True

    def finish(self) -> str:
        """The end of the text: what was held back is content (an unclosed call as written)."""
        rest = (self._gap + self._open + self._pending) if self._inside else self._pending
        if self._after_call and not self._inside:
            rest = rest.lstrip()
        self._pending, self._inside = "", False
        return rest
