"""`OutputTracker`: per child request, incremental text, stop strings, logprobs and the stop reason
(shared by the offline `LLM` and the `SchedulerActor`)."""

from __future__ import annotations

from coserve.contract.plan import TokenLogprobs
from coserve.frontend.detokenizer import TextTracker
from coserve.frontend.logprobs import SampleLogprobs, to_logprob_dict
from coserve.policies.request import Request


class OutputTracker:
    """Front-end state of one child request: its text, stop strings and logprobs.

    Args:
        request: the scheduler request (its output tokens are read, never changed).
        tokenizer: decodes tokens.
    """

    def __init__(self, request: Request, tokenizer: object) -> None:
        self.request = request
        self._tokenizer = tokenizer
        self.text = TextTracker(tokenizer, request.sampling)
        want = request.sampling.logprobs is not None
        self.logprobs: SampleLogprobs | None = [] if want else None
        self.cumulative_logprob: float | None = 0.0 if want else None

    def on_token(self, lp: TokenLogprobs | None) -> bool:
        """Take the request's newest token (and its logprobs).

        Returns:
            True when the text now contains a stop string and the request is not finished yet: the
            caller finishes it with `FINISHED_STOPPED`.
        """
        if self.logprobs is not None and lp is not None:
            self.logprobs.append(to_logprob_dict(lp, self._tokenizer))
            self.cumulative_logprob += lp.logprob
        stopped = self.text.check_stop(self.request.output_token_ids)
        return stopped is not None and not self.request.is_finished

    @property
    def stop_reason(self) -> int | str | None:
        """The stop string or stop token id that ended the output, if any."""
        if self.text.stopped is not None:
            return self.text.stopped.stop
        outputs = self.request.output_token_ids
        if outputs and outputs[-1] in self.request.sampling.stop_token_ids:
            return outputs[-1]
        return None

    def final_text(self) -> str:
        return self.text.final_text(self.request.output_token_ids)
