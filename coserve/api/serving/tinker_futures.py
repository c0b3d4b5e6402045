"""What the gateway keeps for Tinker clients: their sessions, sampling sessions and futures.

Every Tinker call answers with a future id, retrieved later (`retrieve_future`). A training call's
future is the scheduler's call (`CallFuture`); a sample's is a task of this gateway (`SampleFuture`);
a call answered at once (`create_model`) is `ReadyFuture`. Each belongs to one tenant: another tenant
asking for it gets "not found". A future is forgotten once its outcome is delivered, and a sample's
outcome after `KEEP_DONE_S` if no one asks.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from coserve.contract.messages import AdapterSpec

KEEP_DONE_S = 600.0


@dataclass(slots=True)
class ReadyFuture:
    body: dict[str, Any]


@dataclass(slots=True)
class CallFuture:
    call_id: str
    opens_sampler: bool = False  # a nameless sampler save: its outcome opens a sampling session on it


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
        self._sessions: dict[str, str] = {}  # session id -> tenant
        self._sampling: dict[str, SamplingSession] = {}
        self._futures: dict[str, tuple[str, Future]] = {}

    def open_session(self, tenant: str) -> str:
        session_id = f"session-{uuid.uuid4().hex[:24]}"
        self._sessions[session_id] = tenant
        return session_id

    def has_session(self, tenant: str, session_id: str) -> bool:
        return self._sessions.get(session_id) == tenant

    def open_sampling(self, session: SamplingSession) -> str:
        sampling_id = f"sampling-{uuid.uuid4().hex[:24]}"
        self._sampling[sampling_id] = session
        return sampling_id

    def sampling(self, tenant: str, sampling_id: str) -> SamplingSession | None:
        session = self._sampling.get(sampling_id)
        return session if session is not None and session.tenant == tenant else None

    def add(self, tenant: str, future: Future, future_id: str | None = None) -> str:
        """Keep `future` under a new id (or `future_id`: a scheduler call's own)."""
        self._expire()
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
            if isinstance(future, SampleFuture) and future.task.done() and now - future.created > KEEP_DONE_S:
                del self._futures[future_id]
