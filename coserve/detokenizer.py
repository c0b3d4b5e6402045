"""Turning output token ids into text: stop strings and logprob decoding.

Stop strings are checked on the text, which only the front end has (the scheduler sees token ids);
when one matches, the front end asks the scheduler to finish the request with `stop`.
"""

from __future__ import annotations

from dataclasses import dataclass

from coserve.outputs import Logprob
from coserve.policies.plan import TokenLogprobs
from coserve.policies.request import SamplingParams


@dataclass(slots=True)
class StopMatch:
    text: str  # the output text cut at the stop string (kept when include_stop_str_in_output)
    stop: str


class TextTracker:
    """Decodes one request's outputs and watches for its stop strings."""

    def __init__(self, tokenizer: object, sampling: SamplingParams) -> None:
        self._tokenizer = tokenizer
        self._sampling = sampling
        self._checked_len = 0  # text before this offset was searched already
        self.stopped: StopMatch | None = None

    def decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=self._sampling.skip_special_tokens)

    def check_stop(self, token_ids: list[int]) -> StopMatch | None:
        """Search the newly decoded text for a stop string; remember and return the first match."""
        stops = self._sampling.stop
        if not stops or self.stopped is not None:
            return self.stopped
        text = self.decode(token_ids)
        # A stop string may straddle the previous boundary: re-search its last len(stop)-1 chars.
        start = max(0, self._checked_len - max(len(s) for s in stops) + 1)
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

    def final_text(self, token_ids: list[int]) -> str:
        return self.stopped.text if self.stopped is not None else self.decode(token_ids)


def to_logprob_dict(lp: TokenLogprobs, tokenizer: object) -> dict[int, Logprob]:
    """vLLM's per-token logprob dict: the sampled token and the top-N alternatives."""
    # The sampled token comes first, as in vLLM, then the alternatives by rank.
    out = {lp.token_id: Logprob(logprob=lp.logprob, rank=lp.rank,
                                decoded_token=tokenizer.decode([lp.token_id]))}
    for i, (tid, value) in enumerate(zip(lp.top_token_ids, lp.top_logprobs)):
        out.setdefault(tid, Logprob(logprob=value, rank=i + 1, decoded_token=tokenizer.decode([tid])))
    return out
