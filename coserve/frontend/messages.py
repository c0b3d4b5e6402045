"""What the gateway's endpoints and its frontend (`SchedulerFrontend`) exchange, in the gateway's process:
a chat conversation or a completions prompt as the endpoint validated it (`ChatSubmission`, answered by
`ChatAdmission`), then `StreamBatch`es of text until one has `done`. The frontend turns them into the
scheduler's token-level messages (`coserve.contract.messages`) and back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from coserve.contract.messages import AdapterSpec, Rejection
from coserve.contract.sampling import SamplingParams
from coserve.tools.family import ToolFamily
from coserve.tools.spec import ToolSpec


@dataclass(slots=True)
class RawPrompt:
    """A completions prompt, sent to the model as is (no chat template): text or token ids, one set.

    Text is tokenized with the tokenizer's special tokens (a BOS where the model has one), as vLLM's
    completions endpoint does; token ids are taken as they are (checked against the vocabulary).
    """

    text: str | None = None
    token_ids: list[int] | None = None
    echo: bool = False  # the client wants the prompt's text back (`ChatAdmission.prompt_text`)


@dataclass(slots=True)
class ChatSubmission:
    """One chat completion request (or one prompt of a completions request), validated by the gateway.

    The prompt is `messages` rendered with the chat template, or, when `raw` is set, that raw prompt
    (`messages` is then empty). `sampling.max_tokens` is the client's limit or None (the frontend
    fills in the room left in the context); `sampling.n` completions are generated.
    """

    request_id: str
    tenant: str
    messages: list[dict[str, Any]]
    sampling: SamplingParams
    adapter: AdapterSpec | None = None
    tools: ToolSpec | None = None  # the request's tools (rendered by the chat template)
    raw: RawPrompt | None = None
    counts_request: bool = True  # False: a later prompt of one completions request (counted once)
    retain_kv_s: float = 0.0  # keep the conversation's KV this long once it ends (a stored response)


@dataclass(slots=True)
class ChatAdmission:
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
    cached_tokens: int = 0  # prompt tokens whose KV was already cached (OpenAI's `cached_tokens`)
