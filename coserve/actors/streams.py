"""The scheduler's state of one submission: its `n` child requests and the token stream the gateway reads.

Deltas accumulate between reads and are taken as one `TokenBatch`, so a slow reader gets bigger batches
instead of a growing backlog of messages. Token ids only: the gateway decodes them (`TextStream`).
"""

from __future__ import annotations

import asyncio
import time

from coserve.contract.messages import TokenBatch, TokenDelta
from coserve.contract.plan import TokenLogprobs
from coserve.inference.request import Request


class SubmissionState:
    """Children, what was already sent of each, timing for TTFT/TPOT, and the pending deltas.

    Args:
        tenant: who asked.
        children: one request per choice (choice index = position).
        prompt_tokens: the prompt's length (counted once for all choices, as OpenAI does).
        estimate: tokens charged against the tenant's quota at admission.
        arrival: `time.monotonic()` at admission.
        notify: an event shared by the submissions of one gateway replica, set on every change.
        origin: that gateway replica ("" in-process).
    """

    def __init__(self, tenant: str, children: list[Request], prompt_tokens: int, estimate: int,
                 arrival: float, notify: asyncio.Event | None = None, origin: str = "") -> None:
        self.tenant = tenant
        self.origin = origin
        self._notify = notify  # set with `changed`: wakes a poller of many submissions
        self.children = children
        self.prompt_tokens = prompt_tokens
        self.estimate = estimate
        self.arrival = arrival
        self.changed = asyncio.Event()
        self.done = False
        self.closed_at: float | None = None  # time.monotonic() at close()
        self.error: str | None = None
        n = len(children)
        self._sent = [0] * n
        self._logprobs: list[list[TokenLogprobs]] = [[] for _ in range(n)]  # not sent yet
        self._reported_finish = [False] * n
        self._first_at: list[float | None] = [None] * n
        self._last_at: list[float | None] = [None] * n
        self._pending: list[TokenDelta] = []

    def on_token(self, index: int, now: float, logprobs: TokenLogprobs | None = None) -> float | None:
        """Record a token of child `index` at `now` (with its logprobs when the child asked for them);
        returns the TTFT when it is the child's first."""
        if logprobs is not None and self.children[index].sampling.logprobs is not None:
            self._logprobs[index].append(logprobs)
        self._last_at[index] = now
        if self._first_at[index] is None:
            self._first_at[index] = now
            return now - self.arrival
        return None

    def tpot(self, index: int) -> float | None:
        """Mean time between child `index`'s output tokens (None with fewer than two)."""
        count = self.children[index].num_output_tokens
        first, last = self._first_at[index], self._last_at[index]
        if count < 2 or first is None or last is None:
            return None
        return (last - first) / (count - 1)

    def completion_tokens(self) -> int:
        return sum(child.num_output_tokens for child in self.children)

    def all_finished(self) -> bool:
        return all(child.is_finished for child in self.children)

    def emit(self) -> None:
        """Queue each child's new tokens, logprobs and (once) its finish reason; wake the reader."""
        for index, child in enumerate(self.children):
            tokens = child.output_tokens_since(self._sent[index])
            finish = child.finish_reason if child.is_finished and not self._reported_finish[index] else None
            if not tokens and finish is None:
                continue
            self._sent[index] += len(tokens)
            self._reported_finish[index] = self._reported_finish[index] or finish is not None
            logprobs = None
            if child.sampling.logprobs is not None:
                logprobs, self._logprobs[index] = self._logprobs[index], []
            self._pending.append(TokenDelta(index=index, token_ids=tokens, logprobs=logprobs, finish_reason=finish))
        self._wake()

    def close(self) -> None:
        """The submission is over (finished, aborted or failed): the next batch is the last."""
        self.done = True
        self.closed_at = time.monotonic()
        self._wake()

    def _wake(self) -> None:
        self.changed.set()
        if self._notify is not None:
            self._notify.set()

    def take(self) -> TokenBatch:
        """Everything pending, as one batch."""
        self.changed.clear()
        batch = TokenBatch(deltas=self._pending, done=self.done, error=self.error,
                           cached_tokens=self.children[0].num_cached_tokens or 0)
        self._pending = []
        return batch
