"""What `POST /v1/chat/completions` and `POST /v1/completions` share: the sampling fields and their
conversion to engine `SamplingParams`.

Each endpoint's body derives from `SamplingRequest` and adds its own prompt, output limit and logprobs
fields; `SamplingRequest.sampling_params` is the one place where the shared wire parameters become
engine parameters. A body names its `param_support` table in `PARAMS` (`strict.RequestModel`): what it
refuses is a 400 naming the parameter before any other check; any field neither declared here nor listed
there is a 400 `Unrecognized request argument supplied`.
"""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import Field, field_validator, model_validator

from coserve.api.protocol.base import param_error, value_error
from coserve.api.protocol.strict import RequestBody, RequestModel
from coserve.contract.sampling import SamplingParams
from coserve.contract.structured_output import StructuredOutput

MAX_STOP_SEQUENCES = 4
MAX_N = 128  # OpenAI's bound on `n`; a server may cap it lower (`coserve serve --max-n`)
_TOKEN_ID = re.compile(r"[0-9]{1,10}")


class StreamOptions(RequestModel):
    """Options of a streamed response."""

    include_usage: bool | None = None
    include_obfuscation: bool | None = None  # OpenAI's: accepted and not used (no obfuscation padding)


class SamplingRequest(RequestBody):
    """The sampling fields of a generation request (OpenAI's, then the vLLM/coserve extensions).

    Every sampling control is honoured, per sequence inside the batched sampler:
    `frequency_penalty` and `presence_penalty` (OpenAI's, -2..2), `logit_bias` (token id as a string ->
    -100..100; an id outside the model's vocabulary is refused at admission, param `logit_bias`) and
    the vLLM extensions `repetition_penalty` (> 0, 1 is off) and `min_p` (0..1). Exact definitions:
    `coserve.torch_engine.logits_processors`. Types are strict (`coserve.api.protocol.strict`).
    """

    model: str
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = 0.0
    logit_bias: dict[str, Annotated[int, Field(ge=-100, le=100)]] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] | None = 1
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = 0.0
    seed: Annotated[int, Field(ge=-(2**63), le=2**64 - 1)] | None = None
    stop: Annotated[str, Field(min_length=1)] | Annotated[
        list[Annotated[str, Field(min_length=1)]], Field(max_length=MAX_STOP_SEQUENCES)] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = 1.0
    top_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = 1.0
    user: str | None = None

    # --- coserve extensions, vLLM's names (not in the OpenAI spec; send them with `extra_body=`) ---
    top_k: Annotated[int, Field(ge=-1)] | None = None
    min_tokens: Annotated[int, Field(ge=0)] = 0
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    repetition_penalty: Annotated[float, Field(gt=0.0, allow_inf_nan=False)] | None = None  # vLLM's
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None  # vLLM's
    # --- end of coserve extensions ---

    @field_validator("logit_bias")
    @classmethod
    def _token_id_keys(cls, bias: dict[str, int] | None) -> dict[str, int] | None:
        # JSON object keys are strings: OpenAI's keys are token ids written in decimal ("50256").
        for key in bias or {}:
            if not _TOKEN_ID.fullmatch(key):
                raise value_error(f"keys must be token ids (integers written as strings, such as "
                                  f"\"50256\"), got {key[:40]!r}")
        return bias

    @model_validator(mode="after")
    def _check_stream_options(self) -> SamplingRequest:
        if self.stream_options is not None and not self.stream:
            raise param_error("stream_options", "'stream_options' is only allowed when 'stream' is true")
        return self

    @property
    def include_usage(self) -> bool:
        """Whether a stream ends with a usage chunk (`choices: []`)."""
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        structured_output: StructuredOutput | None = None) -> SamplingParams:
        """Engine sampling parameters for this request.

        Args:
            max_tokens: the output limit (None: the room left in the context, filled in by the
                scheduler, which also checks a client limit against the context).
            logprobs: top logprobs per output token (None: no logprobs; 0: the sampled token's only).
            structured_output: a grammar the output must follow.

        Raises:
            ValueError: a combination the engine refuses (its message names the parameter).
        """
        top_p = 1.0 if self.top_p is None else self.top_p
        top_k = -1 if self.top_k is None else self.top_k
        if top_p == 0.0:
            # OpenAI allows top_p=0: keep only the most likely token. The engine needs top_p > 0.
            top_p, top_k = 1.0, 1
        return SamplingParams(
            n=self.n or 1,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=top_p,
            top_k=top_k,
            seed=self.seed,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            structured_output=structured_output,
            frequency_penalty=self.frequency_penalty or 0.0,
            presence_penalty=self.presence_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            min_p=self.min_p or 0.0,
            logit_bias={int(token): float(bias) for token, bias in self.logit_bias.items()}
            if self.logit_bias else None,
        )
