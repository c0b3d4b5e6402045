"""`TextStream`: the text side of one submission's stream, in the gateway. Token batches from the
scheduler in, text batches for the endpoint out.

Each choice has an `OutputTracker`: tokens are decoded incrementally, stop strings are searched in the
text, logprobs are decoded. Text is released through `stream_text`: a possible stop-string prefix is
held back until it is known not to be one. When a stop string appears, the choice ends there: its last
delta says `stop`, the tokens after it are not taken (usage counts the tokens up to the one that
completed the stop string), and `apply` names the choice so that the caller tells the scheduler to
stop generating it (vLLM's split: the frontend owns the detokenizer and the stop strings).
"""

from __future__ import annotations

from typing import Any

from coserve.contract.messages import TokenBatch, TokenDelta
from coserve.contract.sampling import SamplingParams
from coserve.frontend.messages import LogprobEntry, OutputDelta, StreamBatch
from coserve.frontend.output_tracker import OutputTracker


class TextStream:
    """The choices of one submission, as text.

    Args:
        sampling: the submission's sampling settings (each choice's stop strings and logprobs).
        tokenizer: decodes the tokens.
        prompt_tokens: the prompt's length, reported in every batch (usage).
    """

    def __init__(self, sampling: SamplingParams, tokenizer: Any, prompt_tokens: int) -> None:
        self._trackers = [OutputTracker(sampling, tokenizer) for _ in range(sampling.n)]
        self._top_n = sampling.logprobs or 0
        self.prompt_tokens = prompt_tokens
        self._sent_text = [0] * sampling.n
        self._sent_logprobs = [0] * sampling.n
        self._finish: list[str | None] = [None] * sampling.n

    def apply(self, batch: TokenBatch) -> tuple[StreamBatch, list[int]]:
        """The text of `batch`, and the choices a stop string has just ended (to stop in the scheduler)."""
        deltas: list[OutputDelta] = []
        stopped: list[int] = []
        for delta in batch.deltas:
            if self._finish[delta.index] is not None:
                continue  # ended by a stop string: what the engine made after it is past the end
            out, stop = self._take(delta)
            if stop:
                stopped.append(delta.index)
            if out is not None:
                deltas.append(out)
        completion = sum(len(tracker.token_ids) for tracker in self._trackers)
        return StreamBatch(deltas=deltas, done=batch.done, error=batch.error, prompt_tokens=self.prompt_tokens,
                           completion_tokens=completion, cached_tokens=batch.cached_tokens), stopped

    def _take(self, delta: TokenDelta) -> tuple[OutputDelta | None, bool]:
        """One choice's new tokens as text; True when a stop string ended it here."""
        index = delta.index
        tracker = self._trackers[index]
        taken = tracker.add(delta.token_ids, delta.logprobs)
        finish = delta.finish_reason
        # A stop string ends the choice with `stop`, unless it completed on the very token the engine
        # finished the choice with: the engine's reason (EOS, length) stands then.
        stop = tracker.stopped and (finish is None or taken < len(delta.token_ids))
        if stop:
            finish = "stop"
        self._finish[index] = finish
        text = tracker.stream_text(finish is not None)
        new_text = text[self._sent_text[index]:]
        self._sent_text[index] = len(text)
        if not new_text and not taken and finish is None:
            return None, False
        return OutputDelta(index=index, text=new_text, num_tokens=taken, logprobs=self._new_logprobs(index),
                           finish_reason=finish), stop

    def _new_logprobs(self, index: int) -> list[LogprobEntry] | None:
        logprobs = self._trackers[index].logprobs
        if logprobs is None:
            return None
        start, self._sent_logprobs[index] = self._sent_logprobs[index], len(logprobs)
        entries = []
        for per_token in logprobs[start:]:
            sampled = next(iter(per_token.values()))  # the sampled token comes first
            ranked = [(lp.rank, lp) for lp in per_token.values() if lp.rank is not None and lp.rank <= self._top_n]
            top = [lp for _, lp in sorted(ranked, key=lambda pair: pair[0])]
            entries.append(LogprobEntry(token=sampled.decoded_token or "", logprob=sampled.logprob,
                                        top=[(lp.decoded_token or "", lp.logprob) for lp in top]))
        return entries
