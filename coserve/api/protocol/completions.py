"""`POST /v1/completions` (OpenAI's legacy completions, as vLLM serves them): the request, the
`text_completion` response and its streamed chunks.

Reference: https://platform.openai.com/docs/api-reference/completions. The prompt goes to the model as
is, without the chat template. The sampling fields are shared with chat (`coserve.api.protocol.sampling`);
what this endpoint refuses or takes differently is listed in `param_support.COMPLETIONS`.
"""

from __future__ import annotations

import uuid
from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from coserve.api.protocol.base import OpenAIBaseModel, UsageInfo, now, param_error, value_error
from coserve.api.protocol.param_support import COMPLETIONS, EndpointParams
from coserve.api.protocol.sampling import MAX_N, SamplingRequest
from coserve.contract.sampling import SamplingParams
from coserve.frontend.messages import RawPrompt

MAX_LOGPROBS = 5  # OpenAI's bound on the legacy `logprobs`
DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions

TokenId = Annotated[int, Field(ge=0)]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]
# OpenAI's four prompt forms; strict types keep a list of token ids from being read as text.
Prompt = (str | Annotated[list[str], Field(min_length=1)] | TokenIds
          | Annotated[list[TokenIds], Field(min_length=1)])
FinishReason = Literal["stop", "length", "content_filter", "grammar_error"]


class CompletionRequest(SamplingRequest):
    """The body of `POST /v1/completions`.

    `n` completions per prompt; choice `index` = prompt index x `n` + i, as OpenAI. `max_tokens` defaults
    to 16 (null: the room left in the context). `echo` puts each prompt's text before its choices'
    text; with `logprobs` it is refused (the engine computes no prompt logprobs). `best_of` must equal
    `n`, and `suffix` is refused (`param_support.COMPLETIONS`).
    """

    PARAMS: ClassVar[EndpointParams | None] = COMPLETIONS

    prompt: Prompt
    best_of: Annotated[int, Field(ge=1, le=MAX_N)] | None = None
    echo: bool | None = False
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = DEFAULT_MAX_TOKENS
    suffix: str | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt_form(cls, prompt: Any) -> Any:
        # A list mixing forms would otherwise fail each union branch at some item and be reported as a
        # type error at that item; this names the rule instead.
        if isinstance(prompt, list) and prompt:
            kinds = {"text" if isinstance(p, str) else "list" if isinstance(p, list)
                     else "id" if isinstance(p, int) and not isinstance(p, bool) else "other" for p in prompt}
            if len(kinds) > 1 or kinds == {"other"}:
                raise value_error("expected a string, an array of strings, an array of token ids or an array "
                                  "of arrays of token ids, not an array mixing them or of other values")
        return prompt

    @model_validator(mode="after")
    def _check_cross_fields(self) -> CompletionRequest:
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise param_error("best_of", f"'best_of' must equal 'n' ({self.n or 1}): this server does not "
                              "generate extra completions to rank")
        if self.echo and self.logprobs is not None:
            raise param_error("echo", "'echo' cannot be combined with 'logprobs': this server does not "
                              "compute the prompt tokens' logprobs")
        return self

    def prompts(self) -> list[RawPrompt]:
        """One `RawPrompt` per prompt, in order."""
        echo = bool(self.echo)
        prompt = self.prompt
        if isinstance(prompt, str):
            return [RawPrompt(text=prompt, echo=echo)]
        if isinstance(prompt[0], str):
            return [RawPrompt(text=text, echo=echo) for text in prompt]
        if isinstance(prompt[0], int):
            return [RawPrompt(token_ids=list(prompt), echo=echo)]
        return [RawPrompt(token_ids=list(ids), echo=echo) for ids in prompt]

    def to_sampling_params(self) -> SamplingParams:
        """Engine sampling parameters of each prompt (`n` completions each)."""
        return self.sampling_params(max_tokens=self.max_tokens, logprobs=self.logprobs)


def _completion_id() -> str:
    return f"cmpl-{uuid.uuid4().hex}"


class CompletionLogprobs(OpenAIBaseModel):
    """The legacy logprobs of a choice, one entry per output token in each list.

    `top_logprobs[i]` maps the `logprobs` most likely tokens, and the sampled one (OpenAI: "up to
    logprobs+1 elements"), to their log probabilities; `text_offset[i]` is where token i starts in the
    choice's `text`.
    """

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(OpenAIBaseModel):
    """One completion of one prompt; in a streamed chunk, a piece of it (`finish_reason` in its last)."""

    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None = None


class Completion(OpenAIBaseModel):
    """The `text_completion` object: the response, and each SSE event of a stream.

    With `stream_options.include_usage` every chunk carries `usage: null` and one extra final chunk
    has `choices: []` and the usage.
    """

    id: str = Field(default_factory=_completion_id)
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None
