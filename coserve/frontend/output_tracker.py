"""`OutputTracker`: the text side of one choice (one child request): its output tokens, their text
(decoded incrementally), stop strings, decoded logprobs and the stop reason. The gateway keeps one per
choice of every stream (`TextStream`); the offline `LLM` one per request it runs."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from coserve.contract.plan import TokenLogprobs
from coserve.contract.sampling import SamplingParams
from coserve.frontend.detokenizer import TextTracker
from coserve.frontend.logprobs import SampleLogprobs, to_logprob_dict


class OutputTracker:
    """Output tokens of one choice, taken in order, and what the tokenizer makes of them.

    Args:
        sampling: the choice's sampling settings (stop strings, logprobs, special tokens, stop ids).
        tokenizer: decodes tokens.
    """

    def __init__(self, sampling: SamplingParams, tokenizer: Any) -> None:
        self.sampling = sampling
        self._tokenizer = tokenizer
        self.token_ids: list[int] = []
        self.text = TextTracker(tokenizer, sampling)
        want = sampling.logprobs is not None
        self.logprobs: SampleLogprobs | None = [] if want else None
        self.cumulative_logprob: float | None = 0.0 if want else None

    @property
    def stopped(self) -> bool:
        """A stop string appeared in the text: the output ends there, later tokens are not taken."""
        return self.text.stopped is not None

    def add(self, token_ids: Sequence[int], logprobs: Sequence[TokenLogprobs] | None = None) -> int:
        """Take the next output tokens (with their logprobs, when asked for), in order, up to the one
        that completes a stop string.

        Returns:
            How many were taken: fewer than given when a stop string matched (the caller finishes the
            request with `stop`; the rest lie past the end of the output).
        """
        for i, token in enumerate(token_ids):
            if self.stopped:
                return i
            self.token_ids.append(token)
            lp = logprobs[i] if logprobs is not None and i < len(logprobs) else None
            if self.logprobs is not None and lp is not None:
                self.logprobs.append(to_logprob_dict(lp, self._tokenizer))
                assert self.cumulative_logprob is not None  # set with `logprobs`
                self.cumulative_logprob += lp.logprob
            self.text.check_stop(self.token_ids)
        return len(token_ids)

    @property
    def stop_reason(self) -> int | str | None:
        """The stop string or stop token id that ended the output, if any."""
        if self.text.stopped is not None:
            return self.text.stopped.stop
        if self.token_ids and self.token_ids[-1] in (self.sampling.stop_token_ids or ()):
            return self.token_ids[-1]
        return None

    def stream_text(self, finished: bool) -> str:
        """The text safe to send so far (a possible stop-string prefix held back until `finished`)."""
        return self.text.stream_text(finished)

    def final_text(self) -> str:
        return self.text.final_text(self.token_ids)
