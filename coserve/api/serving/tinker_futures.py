"""What the gateway keeps for Tinker clients: their sessions, sampling sessions and futures.

Every Tinker call answers with a future id, retrieved later (`retrieve_future`). A training call's
future is the scheduler's call (`CallFuture`); a sample's is a task of this gateway (`SampleFuture`);
a call answered at once (`create_model`) is `ReadyFuture`. Each belongs to one tenant: another tenant
asking for it gets "not found". A future is forgotten once its outcome is delivered, a sample's
outcome after `KEEP_DONE_S` if no one asks, any other after `KEEP_UNREAD_S`.

What one tenant keeps here is bounded: `MAX_SESSIONS` open sessions (a session silent for
`SESSION_TIMEOUT_S`, no heartbeat, is closed), `MAX_SAMPLING` sampling sessions (the oldest goes when a
new one would pass it: an RL loop opens one per step) and `MAX_FUTURES` futures not yet retrieved (a
429 past it, which the SDK retries).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from coserve.api.protocol.base import ProtocolError
from coserve.contract.messages import AdapterSpec

KEEP_DONE_S = 600.0
KEEP_UNREAD_S = 3600.0  # the scheduler keeps a done call's outcome as long (`training_runs.KEEP_UNREAD_S`)
SESSION_TIMEOUT_S = 120.0  # as the scheduler's runs (`training_runs.SESSION_TIMEOUT_S`)
MAX_SESSIONS = 64
MAX_SAMPLING = 1024
MAX_FUTURES = 4096


@dataclass(slots=True)
class ReadyFuture:
    body: dict[str, Any]
    created: float = field(default_factory=time.monotonic)


@dataclass(slots=True)
class CallFuture:
    call_id: str
    opens_sampler: bool = False  # a nameless sampler save: its outcome opens a sampling session on it
    created: float = field(default_factory=time.monotonic)


@dataclass(slots=True)
class SampleFuture:
    task: asyncio.Task[bytes]
    created: float = field(default_factory=time.monotonic)


Future = ReadyFuture | CallFuture | SampleFuture


@dataclass(slots=True)
class SamplingSession:
    tenant: str
    adapter: AdapterSpec | None  # None: the base model
    base_model: str
    model_path: str | None  # the sampler's tinker:// path (None: the base model)


class TinkerFutures:
    """Sessions, sampling sessions and futures, per tenant (module docstring)."""

    def __init__(self) -> None:
        self._sessions: dict[str, tuple[str, float]] = {}  # session id -> (tenant, last seen)
        self._runs: dict[str, set[str]] = {}  # session id -> its runs (they end with it)
        self._sampling: dict[str, SamplingSession] = {}  # oldest first
        self._futures: dict[str, tuple[str, Future]] = {}

    def open_session(self, tenant: str) -> str:
        """A new session of the tenant (a 429 when it has `MAX_SESSIONS` open: close one, or wait for a
        silent one to time out)."""
        now = time.monotonic()
        for session_id, (_, seen) in list(self._sessions.items()):
            if now - seen > SESSION_TIMEOUT_S:
                del self._sessions[session_id]
                self._runs.pop(session_id, None)
        if sum(1 for owner, _ in self._sessions.values() if owner == tenant) >= MAX_SESSIONS:
            raise ProtocolError(f"You have {MAX_SESSIONS} Tinker sessions open, the most a tenant may: close one "
                                f"(ServiceClient.close()) or let it time out ({SESSION_TIMEOUT_S:g} s without a "
                                "heartbeat).", status=429, type="rate_limit_error", code="too_many_sessions",
                                headers={"retry-after": str(int(SESSION_TIMEOUT_S))})
        session_id = f"session-{uuid.uuid4().hex[:24]}"
        self._sessions[session_id] = (tenant, now)
        return session_id

    def has_session(self, tenant: str, session_id: str) -> bool:
        """Whether the session is the tenant's and open; it counts as seen now."""
        entry = self._sessions.get(session_id)
        if entry is None or entry[0] != tenant:
            return False
        self._sessions[session_id] = (tenant, time.monotonic())
        return True

    def close_session(self, tenant: str, session_id: str) -> None:
        if self.has_session(tenant, session_id):
            del self._sessions[session_id]
            self._runs.pop(session_id, None)

    def add_run(self, session_id: str, run_id: str) -> None:
        """A run of the session was created (it ends with the session)."""
        self._runs.setdefault(session_id, set()).add(run_id)

    def live_runs(self, tenant: str) -> int:
        """The tenant's runs in its open sessions (what the fine-tuning endpoints count against
        `max_concurrent_jobs`; read from the endpoints' threads: one snapshot of each dict)."""
        now = time.monotonic()
        sessions = dict(self._sessions)
        return sum(len(runs) for session_id, runs in dict(self._runs).items()
                   if session_id in sessions and sessions[session_id][0] == tenant
                   and now - sessions[session_id][1] <= SESSION_TIMEOUT_S)

    def open_sampling(self, session: SamplingSession) -> str:
        """A sampling session; the tenant's oldest goes when it has `MAX_SAMPLING` already."""
        mine = [k for k, s in self._sampling.items() if s.tenant == session.tenant]
        for sampling_id in mine[:max(0, len(mine) - MAX_SAMPLING + 1)]:
            del self._sampling[sampling_id]
        sampling_id = f"sampling-{uuid.uuid4().hex[:24]}"
        self._sampling[sampling_id] = session
        return sampling_id

    def sampling(self, tenant: str, sampling_id: str) -> SamplingSession | None:
        session = self._sampling.get(sampling_id)
        return session if session is not None and session.tenant == tenant else None

    def check_room(self, tenant: str) -> None:
        """A 429 when the tenant has `MAX_FUTURES` futures not retrieved (asked before a call is queued, so
        that a refused call was not queued)."""
        self._expire()
        if sum(1 for owner, _ in self._futures.values() if owner == tenant) >= MAX_FUTURES:
            raise ProtocolError(f"You have {MAX_FUTURES} Tinker futures not retrieved, the most a tenant may: "
                                "retrieve their outcomes first.", status=429, type="rate_limit_error",
                                code="too_many_futures", headers={"retry-after": "5"})

    def add(self, tenant: str, future: Future, future_id: str | None = None) -> str:
        """Keep `future` under a new id (or `future_id`: a scheduler call's own)."""
        future_id = future_id or f"future-{uuid.uuid4().hex[:24]}"
        self._futures[future_id] = (tenant, future)
        return future_id

    def get(self, tenant: str, future_id: str) -> Future | None:
        entry = self._futures.get(future_id)
        return entry[1] if entry is not None and entry[0] == tenant else None

    def forget(self, future_id: str) -> None:
        self._futures.pop(future_id, None)

    def _expire(self) -> None:
        now = time.monotonic()
        for future_id, (_, future) in list(self._futures.items()):
            done = isinstance(future, SampleFuture) and future.task.done() and now - future.created > KEEP_DONE_S
            if done or (not isinstance(future, SampleFuture) and now - future.created > KEEP_UNREAD_S):
                del self._futures[future_id]
