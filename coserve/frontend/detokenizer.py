"""Turning output token ids into text: incremental detokenization, stop strings, logprob decoding.

Stop strings are checked on the text, which only the front end has (the scheduler sees token ids);
when one matches, the front end asks the scheduler to finish the request with `stop`.

Text is decoded incrementally (vLLM's prefix/read offsets): each new token decodes a short window
instead of the whole output, and a token that ends inside a multi-byte character waits for the next
one. The concatenated pieces equal `tokenizer.decode(all_tokens)`: a streamed reply and a non-streamed
one are built by the same code, so they are the same text.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from coserve.contract.sampling import SamplingParams

_INCOMPLETE = "\ufffd"  # what a tokenizer decodes an unfinished UTF-8 sequence to


class TokenDecoder(Protocol):
    """What turns output token ids into text: `coserve.frontend.tokenizer.Tokenizer` (a Hugging Face
    tokenizer, the offline `LLM`'s, decodes a list of ids the same way)."""

    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...


@dataclass(slots=True)
class StopMatch:
    text: str  # the output text cut at the stop string (kept when include_stop_str_in_output)
    stop: str


class TextTracker:
    """Decodes one request's outputs incrementally and watches for its stop strings."""

    def __init__(self, tokenizer: TokenDecoder, sampling: SamplingParams) -> None:
        self._tokenizer = tokenizer
        self._sampling = sampling
        self._tokens: list[int] = []
        self._prefix_offset = 0  # the decode window starts here (a character boundary)
        self._read_offset = 0  # tokens before this offset are in `text`
        self._checked_len = 0  # text before this offset was searched for stop strings already
        self._hold = max((len(s) for s in sampling.stop or ()), default=1) - 1
        self.text = ""
        self.stopped: StopMatch | None = None

    def decode(self, token_ids: Sequence[int]) -> str:
        return self._tokenizer.decode(list(token_ids), skip_special_tokens=self._sampling.skip_special_tokens)

    def update(self, token_ids: Sequence[int], final: bool = False) -> str:
        """Catch up with the request's output tokens (all of them, not just the new ones).

        Args:
            final: the output is complete: decode even an unfinished character (as `decode` would).

        Returns:
            The text added to `text`.
        """
        self._tokens.extend(token_ids[len(self._tokens):])
        if self._read_offset == len(self._tokens):
            return ""
        prefix = self.decode(self._tokens[self._prefix_offset:self._read_offset])
        full = self.decode(self._tokens[self._prefix_offset:])
        if len(full) <= len(prefix) or (full.endswith(_INCOMPLETE) and not final):
            return ""
        delta = full[len(prefix):]
        self.text += delta
        self._prefix_offset, self._read_offset = self._read_offset, len(self._tokens)
        return delta

    def check_stop(self, token_ids: Sequence[int] | None = None) -> StopMatch | None:
        """Search the newly decoded text for a stop string; remember and return the first match.

        Args:
            token_ids: the output so far; when given, `update` runs first.
        """
        if token_ids is not None:
            self.update(token_ids)
        stops = self._sampling.stop
        if not stops or self.stopped is not None:
            return self.stopped
        text = self.text
        # A stop string may straddle the previous boundary: re-search its last len(stop)-1 chars.
        start = max(0, self._checked_len - self._hold)
        best: tuple[int, str] | None = None
        for stop in stops:
            at = text.find(stop, start)
            if at >= 0 and (best is None or at < best[0]):
                best = (at, stop)
        self._checked_len = len(text)
        if best is not None:
            at, stop = best
            end = at + len(stop) if self._sampling.include_stop_str_in_output else at
            self.stopped = StopMatch(text=text[:end], stop=stop)
        return self.stopped

    def final_text(self, token_ids: Sequence[int] | None = None) -> str:
        """The finished output's text: cut at the stop string if one matched."""
        if self.stopped is not None:
            return self.stopped.text
        self.update(self._tokens if token_ids is None else token_ids, final=True)
        return self.text

    def stream_text(self, finished: bool) -> str:
        """The text that is safe to send so far: while running, the last `len(longest stop) - 1`
        characters are held back, since they may turn out to start a stop string."""
        if finished:
            return self.final_text()
        if self._hold and self._sampling.stop:
            return self.text[:max(0, len(self.text) - self._hold)]
        return self.text
