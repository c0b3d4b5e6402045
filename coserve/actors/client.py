"""The gateway's view of the scheduler, token ids in and out: the same async surface in-process
(`--local`) and over Ray (both are `coserve.frontend.scheduler_frontend.SchedulerClient`s). The
gateway's `SchedulerFrontend` sits on top (prompts in, text out).

`LocalSchedulerClient` owns a SchedulerActor and an EngineActor in this process: the scheduler's coroutines
run on the gateway's event loop, the engine loop on a background thread. `RaySchedulerClient` wraps the
SchedulerActor's actor handle (the gateway's Serve replica started the actors and owns them) and reads
every stream of its replica through one `poll` call per iteration.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from coserve.actors.engine_actor import EngineActor, LocalLink
from coserve.actors.scheduler_actor import SchedulerActor
from coserve.contract.messages import Admission, TokenBatch, TokenSubmission
from coserve.contract.training_calls import RunAnswer, RunQuery

# A finished request whose stream was never read (its client left before the response started) is
# forgotten after this long.
UNREAD_TTL_S = 60.0


class LocalSchedulerClient:
    """Scheduler and engine in this process (`coserve serve --local`).

    Args:
        scheduler: the SchedulerActor (the engine gets registered with it here).
        engine: the EngineActor; its loop starts in `start()`.
    """

    def __init__(self, scheduler: SchedulerActor, engine: EngineActor) -> None:
        self.scheduler = scheduler
        self.engine = engine
        scheduler.register_engine(engine.engine_id, engine.layout())

    async def start(self) -> None:
        if not self.engine.running():
            self.engine.start(LocalLink(self.scheduler, asyncio.get_running_loop()))

    async def close(self) -> None:
        await self.scheduler.shutdown()
        self.engine.close()  # an engine whose loop never started ends its thread here
        await asyncio.to_thread(self.engine.join, 30.0)
        self.scheduler.release_data_dir()  # the engine's last result is recorded: another server may start

    async def submit(self, sub: TokenSubmission) -> Admission:
        return await self.scheduler.submit(sub)

    def stream(self, request_id: str) -> AsyncIterator[TokenBatch]:
        return self.scheduler.stream(request_id)

    async def stop(self, request_id: str, index: int) -> bool:
        return await self.scheduler.stop(request_id, index)

    async def abort(self, request_id: str) -> bool:
        return await self.scheduler.abort(request_id)

    async def metrics_text(self) -> str:
        return await self.scheduler.metrics_text()

    async def training(self, query: RunQuery) -> RunAnswer:
        return await self.scheduler.training(query)

    async def health(self) -> str | None:
        if self.engine.running():
            return None
        return f"the engine loop is not running ({self.engine.error or 'stopped'})"


class RaySchedulerClient:
    """A SchedulerActor running as a Ray actor.

    Streams are multiplexed: one pump task per gateway replica calls `poll(origin)`, which returns the
    batches of all of this replica's live requests at once, and hands them to per-request queues. So
    an iteration costs one actor call per replica, not one per live stream.

    Args:
        handle: its `ray.actor.ActorHandle`.
        health_timeout_s: how long `health()` waits for the actor's answer.
        poll_timeout_s: how long one `poll` waits on the actor for news.
    """

    def __init__(self, handle: Any, health_timeout_s: float = 5.0, poll_timeout_s: float = 5.0) -> None:
        self.handle = handle
        self._health_timeout_s = health_timeout_s
        self._poll_timeout_s = poll_timeout_s
        self._origin = f"gateway-{uuid.uuid4().hex[:12]}"
        self._queues: dict[str, asyncio.Queue[TokenBatch]] = {}
        self._pump: asyncio.Task[None] | None = None
        self._unread_done: dict[str, float] = {}  # request id -> when its last batch arrived

    async def start(self) -> None:
        """Nothing to do: the driver created and started the actors."""

    async def close(self) -> None:
        """Stop the pump; the driver owns the actors."""
        if self._pump is not None:
            self._pump.cancel()

    async def submit(self, sub: TokenSubmission) -> Admission:
        sub.origin = self._origin
        # The queue exists before the request does: a running pump may fetch its first batch at once.
        self._queues[sub.request_id] = asyncio.Queue()
        if self._pump is None:
            self._pump = asyncio.get_running_loop().create_task(self._run_pump())
        try:
            admission: Admission = await self.handle.submit.remote(sub)
        except BaseException:
            self._queues.pop(sub.request_id, None)
            raise
        if admission.rejection is not None:
            self._queues.pop(sub.request_id, None)
        return admission

    def stream(self, request_id: str) -> AsyncIterator[TokenBatch]:
        return self._read(request_id, self._queues.get(request_id))

    async def _read(self, request_id: str, queue: asyncio.Queue[TokenBatch] | None) -> AsyncIterator[TokenBatch]:
        if queue is None:
            yield TokenBatch(done=True, error=f"unknown request {request_id!r}")
            return
        try:
            while True:
                batch = await queue.get()
                yield batch
                if batch.done:
                    return
        finally:
            self._queues.pop(request_id, None)
            self._unread_done.pop(request_id, None)

    async def _run_pump(self) -> None:
        try:
            while self._queues:
                batches = await self.handle.poll.remote(self._origin, self._poll_timeout_s)
                now = time.monotonic()
                for request_id, batch in batches.items():
                    queue = self._queues.get(request_id)
                    if queue is not None:
                        queue.put_nowait(batch)
                        if batch.done:
                            self._unread_done[request_id] = now
                self._drop_unread(now)
        except Exception as error:  # noqa: BLE001 - the scheduler is unreachable: fail every stream
            message = f"The scheduler is unreachable: {type(error).__name__}: {error}"
            for queue in self._queues.values():
                queue.put_nowait(TokenBatch(done=True, error=message))
        finally:
            self._pump = None

    def _drop_unread(self, now: float) -> None:
        """Forget finished requests nobody read for `UNREAD_TTL_S` (their client left before the
        response started), so that the pump can stop."""
        for request_id, done_at in list(self._unread_done.items()):
            if now - done_at > UNREAD_TTL_S:
                self._unread_done.pop(request_id)
                self._queues.pop(request_id, None)

    async def stop(self, request_id: str, index: int) -> bool:
        stopped: bool = await self.handle.stop.remote(request_id, index)
        return stopped

    async def abort(self, request_id: str) -> bool:
        aborted: bool = await self.handle.abort.remote(request_id)
        return aborted

    async def metrics_text(self) -> str:
        text: str = await self.handle.metrics_text.remote()
        return text

    async def training(self, query: RunQuery) -> RunAnswer:
        answer: RunAnswer = await self.handle.training.remote(query)
        return answer

    async def health(self) -> str | None:
        try:
            engines = await asyncio.wait_for(self.handle.engines.remote(), self._health_timeout_s)
        except Exception as error:  # noqa: BLE001 - any failure to answer means unhealthy
            return f"the scheduler does not answer: {type(error).__name__}: {error}"
        return None if engines else "no engine is registered"
