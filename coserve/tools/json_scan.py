"""Where a JSON object or array ends, in text that arrives in pieces.

The formats whose calls have no close tag (Llama's bare JSON, Mistral's array after `[TOOL_CALLS]`)
end a call where its outermost bracket closes. `JsonEnd` finds that place by counting brackets outside
strings, scanning each character once however the text is split; whether the text in between is valid
JSON is for `json.loads` to say once it is complete.
"""

from __future__ import annotations

_OPENING = "{["
_CLOSING = "}]"


class JsonEnd:
    """Scans a growing text that starts with `{` or `[` for the end of that value."""

    def __init__(self) -> None:
        self._depth = 0
        self._in_string = False
        self._escaped = False
        self._scanned = 0  # characters of the text already scanned

    def find(self, text: str) -> int | None:
        """The index just past the bracket that closes `text[0]`, or None while it is still open.

        `text` is the whole value so far: each call passes a longer text with the same start.
        """
        for index in range(self._scanned, len(text)):
            char = text[index]
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif char == "\\":
                    self._escaped = True
                elif char == '"':
                    self._in_string = False
            elif char == '"':
                self._in_string = True
            elif char in _OPENING:
                self._depth += 1
            elif char in _CLOSING:
                self._depth -= 1
                if self._depth <= 0:
                    self._scanned = index + 1
                    return index + 1
        self._scanned = len(text)
        return None
