"""What the gateway and the actors send each other: plain dataclasses (they cross Ray calls).

gateway -> SchedulerActor: `ChatSubmission` (answered by `Admission`; a chat conversation, or a
completions prompt as a `RawPrompt`), then `StreamBatch`es until one
has `done`: from `stream(request_id)` in-process, or over Ray from `poll(origin)`, which returns the
batches of all of one gateway replica's requests in one call. EngineActor <-> SchedulerActor: `IterationPlan` and
`IterationResult` (contract/plan.py), or `EngineFailure` (contract/engine.py) when a step raised.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from coserve.contract.sampling import SamplingParams
from coserve.tools.family import ToolFamily
from coserve.tools.spec import ToolSpec


@dataclass(slots=True)
class AdapterSpec:
    """The LoRA adapter of a fine-tuned model, resolved by the gateway from the store."""

    name: str  # the public model id
    path: str  # the PEFT folder


@dataclass(slots=True)
class RawPrompt:
    """A completions prompt, sent to the model as is (no chat template): text or token ids, one set.

    Text is tokenized with the tokenizer's special tokens (a BOS where the model has one), as vLLM's
    completions endpoint does; token ids are taken as they are (checked against the vocabulary).
    """

    text: str | None = None
    token_ids: list[int] | None = None
    echo: bool = False  # the client wants the prompt's text back (`Admission.prompt_text`)


@dataclass(slots=True)
class ChatSubmission:
    """One chat completion request (or one prompt of a completions request), validated by the gateway.

    The prompt is `messages` rendered with the chat template, or, when `raw` is set, that raw prompt
    (`messages` is then empty). `sampling.max_tokens` is the client's limit or None (the scheduler
    fills in the room left in the context); `sampling.n` completions are generated.
    """

    request_id: str
    tenant: str
    messages: list[dict]
    sampling: SamplingParams
    adapter: AdapterSpec | None = None
    origin: str = ""  # the gateway replica that submitted it: `poll(origin)` returns its batches
    tools: ToolSpec | None = None  # the request's tools (rendered by the chat template)
    raw: RawPrompt | None = None
    counts_request: bool = True  # False: a later prompt of one completions request (counted once)


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
    """The answer to a submission: accepted (`prompt_tokens` set) or `rejection`.

    `tool_family` is the model's tool-call format when the gateway must read calls out of the replies
    (tools given, `tool_choice` not `none`, a known family); None otherwise.
    """

    prompt_tokens: int = 0
    rejection: Rejection | None = None
    tool_family: ToolFamily | None = None
    prompt_text: str | None = None  # a `RawPrompt` with `echo`: its text (token ids decoded)


@dataclass(slots=True)
class LogprobEntry:
    """One output token's text, log probability and the top alternatives `(text, logprob)`."""

    token: str
    logprob: float
    top: list[tuple[str, float]] = field(default_factory=list)


@dataclass(slots=True)
class OutputDelta:
    """What one choice gained since the previous batch."""

    index: int
    text: str
    num_tokens: int  # new output tokens
    logprobs: list[LogprobEntry] | None = None
    finish_reason: str | None = None  # set once, in the choice's last delta


@dataclass(slots=True)
class StreamBatch:
    """Deltas gathered since the last batch; the last batch has `done` (and maybe `error`)."""

    deltas: list[OutputDelta] = field(default_factory=list)
    done: bool = False
    error: str | None = None  # the request failed (after it was admitted)
    prompt_tokens: int = 0
    completion_tokens: int = 0  # totals so far, over all choices
