"""The scheduler's state of one chat submission: its `n` children and the stream the gateway reads.

Deltas accumulate between reads and are taken as one `StreamBatch`, so a slow reader gets bigger
batches instead of a growing backlog of messages. Text is released through `TextTracker.stream_text`:
a possible stop-string prefix is held back until it is known not to be one.
"""

from __future__ import annotations

import asyncio
import time

from coserve.contract.messages import LogprobEntry, OutputDelta, StreamBatch
from coserve.frontend.output_tracker import OutputTracker


class SubmissionState:
    """Children, what was already sent of each, timing for TTFT/TPOT, and the pending deltas.

    Args:
        tenant: who asked.
        trackers: one per child (choice index = position).
        prompt_tokens: the prompt's length (counted once for all choices, as OpenAI does).
        estimate: tokens charged against the tenant's quota at admission.
        arrival: `time.monotonic()` at admission.
        notify: an event shared by the submissions of one gateway replica, set on every change.
        origin: that gateway replica ("" in-process).
    """

    def __init__(self, tenant: str, trackers: list[OutputTracker], prompt_tokens: int, estimate: int,
                 arrival: float, notify: asyncio.Event | None = None, origin: str = "") -> None:
        self.tenant = tenant
        self.origin = origin
        self._notify = notify  # set with `changed`: wakes a poller of many submissions
        self.trackers = trackers
        self.prompt_tokens = prompt_tokens
        self.estimate = estimate
        self.arrival = arrival
        self.changed = asyncio.Event()
        self.done = False
        self.closed_at: float | None = None  # time.monotonic() at close()
        self.error: str | None = None
        self._sent_text = [0] * len(trackers)
        self._sent_tokens = [0] * len(trackers)
        self._sent_logprobs = [0] * len(trackers)
        self._reported_finish = [False] * len(trackers)
        self._first_at: list[float | None] = [None] * len(trackers)
        self._last_at: list[float | None] = [None] * len(trackers)
        self._pending: list[OutputDelta] = []

    def on_token(self, index: int, now: float) -> float | None:
        """Record a token of child `index` at `now`; returns the TTFT when it is the child's first."""
        self._last_at[index] = now
        if self._first_at[index] is None:
            self._first_at[index] = now
            return now - self.arrival
        return None

    def tpot(self, tracker: OutputTracker) -> float | None:
        """Mean time between the child's output tokens (None with fewer than two)."""
        index = self.trackers.index(tracker)
        count = tracker.request.num_output_tokens
        first, last = self._first_at[index], self._last_at[index]
        if count < 2 or first is None or last is None:
            return None
        return (last - first) / (count - 1)

    def completion_tokens(self) -> int:
        return sum(t.request.num_output_tokens for t in self.trackers)

    def all_finished(self) -> bool:
        return all(t.request.is_finished for t in self.trackers)

    def emit(self) -> None:
        """Queue each child's new text, logprobs and (once) its finish reason; wake the reader."""
        for index, tracker in enumerate(self.trackers):
            request = tracker.request
            finished = request.is_finished
            text = tracker.text.stream_text(finished)
            new_text = text[self._sent_text[index]:]
            new_tokens = request.num_output_tokens - self._sent_tokens[index]
            finish = request.finish_reason if finished and not self._reported_finish[index] else None
            if not new_text and not new_tokens and finish is None:
                continue
            self._sent_text[index] = len(text)
            self._sent_tokens[index] = request.num_output_tokens
            self._reported_finish[index] = self._reported_finish[index] or finish is not None
            self._pending.append(OutputDelta(index=index, text=new_text, num_tokens=new_tokens,
                                             logprobs=self._new_logprobs(index, tracker),
                                             finish_reason=finish))
        self._wake()

    def _new_logprobs(self, index: int, tracker: OutputTracker) -> list[LogprobEntry] | None:
        if tracker.logprobs is None:
            return None
        start, self._sent_logprobs[index] = self._sent_logprobs[index], len(tracker.logprobs)
        top_n = tracker.request.sampling.logprobs or 0
        entries = []
        for per_token in tracker.logprobs[start:]:
            sampled = next(iter(per_token.values()))  # the sampled token comes first
            top = sorted((lp for lp in per_token.values() if lp.rank is not None and lp.rank <= top_n),
                         key=lambda lp: lp.rank)
            entries.append(LogprobEntry(token=sampled.decoded_token or "", logprob=sampled.logprob,
                                        top=[(lp.decoded_token or "", lp.logprob) for lp in top]))
        return entries

    def close(self) -> None:
        """The submission is over (finished, aborted or failed): the next batch is the last."""
        self.done = True
        self.closed_at = time.monotonic()
        self._wake()

    def _wake(self) -> None:
        self.changed.set()
        if self._notify is not None:
            self._notify.set()

    def take(self) -> StreamBatch:
        """Everything pending, as one batch."""
        self.changed.clear()
        batch = StreamBatch(deltas=self._pending, done=self.done, error=self.error,
                            prompt_tokens=self.prompt_tokens, completion_tokens=self.completion_tokens())
        self._pending = []
        return batch
