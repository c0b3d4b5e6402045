"""Engine supervision on Ray: an engine actor that dies is noticed, its work is ended or rolled back, and
the actor Ray restarts is put back to work.

Runs as a task inside the SchedulerActor (`SchedulerActor.supervise`). Every `interval_s` it asks the
engine whether its loop runs. A dead process (`RayActorError`) or a loop that stopped (the actor is then
killed so that Ray restarts it) is reported to the scheduler with `engine_lost`: every live stream ends
with an error that says so, and the fine-tuning jobs are dropped from memory (the store still has them
running, with their checkpoints). Then it waits for the restarted actor (created with `max_restarts`),
registers it again, which builds a fresh policy and job manager (the jobs resume from their last
checkpoint, as after a server restart), and starts its loop. While no engine is registered, new chat
requests are a 503 and `/health` says why.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Protocol

logger = logging.getLogger(__name__)

# How often the engine is asked whether it runs; a dead engine is noticed within this.
PROBE_INTERVAL_S = 0.5
# Waits between attempts to reach the restarting actor (it loads the weights again).
RESTART_BACKOFF_S = (0.5, 10.0)


class EngineHost(Protocol):
    """What the supervisor needs from the scheduler."""

    def engine_lost(self, engine_id: str, reason: str) -> None: ...

    def register_engine(self, engine_id: str, layout: Any) -> None: ...


class EngineSupervisor:
    """Watches one engine actor and brings it back after a crash.

    Args:
        host: the scheduler (told when the engine is lost and when it is back).
        engine_id: the engine's id in the scheduler.
        handle: the engine's Ray actor handle (created with `max_restarts`).
        link: the `SchedulerLink` handed to the restarted engine's `start`.
        interval_s: seconds between probes.
    """

    def __init__(self, host: EngineHost, engine_id: str, handle: Any, link: Any,
                 interval_s: float = PROBE_INTERVAL_S) -> None:
        self._host, self._engine_id, self._handle, self._link = host, engine_id, handle, link
        self._interval_s = interval_s
        self.restarts = 0

    async def run(self) -> None:
        """Probe forever (until cancelled), restarting the engine after each loss."""
        while True:
            await asyncio.sleep(self._interval_s)
            problem = await self._probe()
            if problem is None:
                continue
            logger.error("engine %s lost: %s; waiting for Ray to restart it", self._engine_id, problem)
            self._host.engine_lost(self._engine_id, problem)
            await self._restart()

    async def _probe(self) -> str | None:
        """None while the engine's loop runs; else what is wrong."""
        import ray

        try:
            running = await self._handle.running.remote()
        except ray.exceptions.RayActorError as error:
            return f"the engine process died ({type(error).__name__})"
        if running:
            return None
        # The process lives but its loop ended: a restart is the only way back to a working engine.
        ray.kill(self._handle, no_restart=False)
        return "the engine loop stopped"

    async def _restart(self) -> None:
        """Wait for the restarted actor, register it (a fresh policy and job manager), start its loop."""
        import ray

        delay, longest = RESTART_BACKOFF_S
        while True:
            try:
                layout = await self._handle.layout.remote()
                self._host.register_engine(self._engine_id, layout)
                try:
                    await self._handle.start.remote(self._link)
                except ray.exceptions.RayError:
                    self._host.engine_lost(self._engine_id, "the restarted engine died before it started")
                    raise
            except ray.exceptions.RayError as error:
                logger.warning("engine %s not back yet (%s); next try in %.1f s", self._engine_id,
                               type(error).__name__, delay)
                await asyncio.sleep(delay)
                delay = min(2 * delay, longest)
                continue
            self.restarts += 1
            logger.warning("engine %s restarted (%d restart(s) so far)", self._engine_id, self.restarts)
            return
