"""What the gateway and the scheduler send each other: plain dataclasses (they cross Ray calls).

The scheduler sees token ids only; the gateway (`coserve.frontend`) owns the tokenizer: it renders and
encodes the prompt, decodes the output and watches the stop strings.

gateway -> SchedulerActor: `TokenSubmission` (answered by `Admission`), then `TokenBatch`es until one
has `done`: from `stream(request_id)` in-process, or over Ray from `poll(origin)`, which returns the
batches of all of one gateway replica's requests in one call. When the gateway's detokenizer finds a
stop string in choice `i`, it calls `stop(request_id, i)`; a client that goes away is `abort(request_id)`.
EngineActor <-> SchedulerActor: `IterationPlan` and `IterationResult` (`plan.py`), or `EngineFailure`
(`engine.py`) when a step raised.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from coserve.contract.plan import TokenLogprobs
from coserve.contract.sampling import EosIds, SamplingParams


@dataclass(slots=True)
class AdapterSpec:
    """The LoRA adapter of a fine-tuned model, resolved by the gateway from the store (and checked)."""

    name: str  # the public model id
    path: str  # the PEFT folder


@dataclass(slots=True)
class TokenSubmission:
    """One prompt to complete `sampling.n` times, as token ids.

    Args:
        sampling: `max_tokens` set (the client's limit, or the room the context leaves).
        eos: the model's EOS id and its other end-of-turn ids (stop tokens unless `ignore_eos`).
        client_max_tokens: the client's own `max_tokens` (None: none given), which the quota
            estimate needs.
        origin: the gateway replica that submitted it: `poll(origin)` returns its batches.
        counts_request: False for a later prompt of one completions request (counted once).
        retain_kv_s: keep the KV of its prompt and output this long once it ends (a stored response whose
            conversation may be continued: `coserve.inference.kv_retention`); 0: the ordinary prefix cache.
    """

    request_id: str
    tenant: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    eos: EosIds
    adapter: AdapterSpec | None = None
    client_max_tokens: int | None = None
    origin: str = ""
    counts_request: bool = True
    retain_kv_s: float = 0.0


@dataclass(slots=True)
class Rejection:
    """Why a submission was refused, as an OpenAI error (the gateway renders it)."""

    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None
    retry_after_s: float | None = None  # set for 429: when to retry


@dataclass(slots=True)
class Admission:
    """The answer to a submission: accepted (`prompt_tokens` set) or `rejection`."""

    prompt_tokens: int = 0
    rejection: Rejection | None = None


@dataclass(slots=True)
class TokenDelta:
    """What one choice gained since the previous batch: its new token ids (with their logprobs when
    asked for) and, in its last delta, why it finished."""

    index: int
    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None


@dataclass(slots=True)
class TokenBatch:
    """Deltas gathered since the last batch; the last batch has `done` (and maybe `error`)."""

    deltas: list[TokenDelta] = field(default_factory=list)
    done: bool = False
    error: str | None = None  # the request failed (after it was admitted)
    cached_tokens: int = 0  # prompt tokens whose KV the prefix cache held when it was first admitted
