"""Output objects of the offline API, shaped like vLLM's (`RequestOutput`, `CompletionOutput`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from coserve.frontend.logprobs import SampleLogprobs


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the stop string or stop token id that ended the output

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
