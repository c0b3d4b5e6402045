"""`EngineActor`: one per GPU. Its loop pulls the next plan from the scheduler and reports the result.

A plain class (`ray.remote(EngineActor)` in cluster mode, in-process with `--local`). The engine lives
on a thread of its own: the thread builds it (loads the weights) and then runs the loop, so every torch
operation of the engine runs on that one thread. Why: torch's OpenMP keeps a team of worker threads per
calling thread, and an engine built on one thread and stepped on another ran its iterations ~40% slower
on a 2-core CPU (measured: benchmarks/RESULTS.md, "Liveness"). One
`SchedulerLink.exchange(engine_id, last_result) -> next plan` call per iteration is all the loop says to
the scheduler. Only plain dataclasses cross that call (`IterationPlan`,
`IterationResult`, `EngineFailure`), never tensors. The engine executes; it decides nothing.
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import threading
import time
from dataclasses import asdict, dataclass, replace
from typing import Any, Protocol

from coserve.contract.engine import Engine, EngineFailure, PlanFault, RuntimeLayout, fault_text
from coserve.contract.plan import IterationPlan, IterationResult

logger = logging.getLogger(__name__)


class SchedulerLink(Protocol):
    """How an engine loop reaches the scheduler."""

    def exchange(self, engine_id: str, result: IterationResult | EngineFailure | None) -> IterationPlan | None:
        """Report `result` (None on the first call) and get the next plan (None: stop)."""


class _AsyncScheduler(Protocol):
    """The SchedulerActor's side of `LocalLink`: its `exchange` coroutine."""

    async def exchange(self, engine_id: str,
                       result: IterationResult | EngineFailure | None) -> IterationPlan | None: ...


class LocalLink:
    """In-process: the scheduler's coroutine runs on the gateway's event loop (`--local`).

    Args:
        scheduler: the SchedulerActor object.
        loop: the running event loop the scheduler lives on.
    """

    def __init__(self, scheduler: _AsyncScheduler, loop: asyncio.AbstractEventLoop) -> None:
        self._scheduler = scheduler
        self._loop = loop

    def exchange(self, engine_id: str, result: IterationResult | EngineFailure | None) -> IterationPlan | None:
        future = asyncio.run_coroutine_threadsafe(self._scheduler.exchange(engine_id, result), self._loop)
        return future.result()


class RayLink:
    """Across processes: a Ray actor call on the SchedulerActor's handle (picklable: send it to the engine).

    Args:
        handle: the scheduler's `ray.actor.ActorHandle`.
    """

    def __init__(self, handle: Any) -> None:
        self._handle = handle

    def exchange(self, engine_id: str, result: IterationResult | EngineFailure | None) -> IterationPlan | None:
        import ray

        plan: IterationPlan | None = ray.get(self._handle.exchange.remote(engine_id, result))
        return plan


@dataclass(slots=True)
class LoopStats:
    """Where the loop's time went, in seconds."""

    iterations: int = 0
    step_s: float = 0.0  # inside Engine.step
    exchange_s: float = 0.0  # in exchange calls: transport + the scheduler's work + idle waits
    failures: int = 0


class EngineActor:
    """An `Engine` and the loop that feeds it plans.

    Args:
        config: the `EngineConfig` (model folder, dtype, device, KV cache and adapter bank sizes).
        engine_id: the name the scheduler knows this engine by.
    """

    def __init__(self, config: Any, engine_id: str = "engine-0") -> None:
        self.engine_id = engine_id
        self.engine: Engine  # the engine thread builds it before the constructor returns
        self._layout: RuntimeLayout
        self._stats = LoopStats()
        self.error: str | None = None  # why the loop ended, when it was not a normal stop
        self._links: queue.Queue[SchedulerLink | None] = queue.Queue(maxsize=1)
        self._built = threading.Event()
        self._build_error: BaseException | None = None
        self._started = False
        self._thread = threading.Thread(target=self._main, args=(config,), name=f"coserve-{engine_id}",
                                        daemon=True)
        self._thread.start()
        self._built.wait()
        if self._build_error is not None:
            raise self._build_error

    def _main(self, config: Any) -> None:
        """The engine thread: build the engine, then run the loop once `start` hands over a link."""
        try:
            from coserve.backends.registry import build_engine
            from coserve.model.tokenizer_spec import read_tokenizer_spec

            self.engine = build_engine(config)  # the backend `config.engine` names
            # The tokenizer as this process loads it (either backend loads the model folder's with
            # transformers), for the gateway and the scheduler, which have no torch.
            self._layout = replace(self.engine.layout, tokenizer=read_tokenizer_spec(config.model))
        except BaseException as error:  # noqa: BLE001 - re-raised by the constructor, on the caller's thread
            self._build_error = error
            return
        finally:
            self._built.set()
        link = self._links.get()
        if link is not None:
            self._run(link)

    def layout(self) -> RuntimeLayout:
        """The engine's `RuntimeLayout` (KV blocks, context length, adapter slots, its tokenizer) for the
        scheduler and the gateway."""
        return self._layout

    def start(self, link: SchedulerLink) -> None:
        """Start the loop on the engine thread.

        Raises:
            RuntimeError: the loop was started before.
        """
        if self._started:
            raise RuntimeError(f"engine {self.engine_id} is already running")
        self._started = True
        self._links.put(link)

    def close(self) -> None:
        """Let the engine thread end without running the loop (when it was never started)."""
        if not self._started:
            self._started = True
            self._links.put(None)

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the loop to end (the scheduler shut down); True when it has."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def running(self) -> bool:
        return self._started and self._thread.is_alive()

    def pid(self) -> int:
        """The process the engine runs in (what an operator or a fault test kills)."""
        return os.getpid()

    def placement(self) -> dict[str, Any]:
        """Where Ray put this engine: its placement group, node and the resources it holds (GPU ids on
        a GPU); empty outside Ray (`--local`)."""
        import sys

        ray = sys.modules.get("ray")
        if ray is None or not ray.is_initialized():
            return {}
        context = ray.get_runtime_context()
        return {"placement_group": context.get_placement_group_id(), "node": context.get_node_id(),
                "resources": context.get_assigned_resources(), "gpu_ids": ray.get_gpu_ids()}

    def stats(self) -> dict[str, float]:
        """`LoopStats` as a dict (plain data for a Ray call)."""
        return asdict(self._stats)

    def _run(self, link: SchedulerLink) -> None:
        result: IterationResult | EngineFailure | None = None
        stats = self._stats
        try:
            while True:
                t0 = time.perf_counter()
                plan = link.exchange(self.engine_id, result)
                t1 = time.perf_counter()
                stats.exchange_s += t1 - t0
                if plan is None:
                    return
                result = self._step(plan)
                stats.step_s += time.perf_counter() - t1
                stats.iterations += 1
        except Exception as error:  # noqa: BLE001 - the scheduler is gone; say why and stop
            self.error = f"{type(error).__name__}: {error}"
            logger.exception("engine %s: the loop stopped", self.engine_id)

    def _step(self, plan: IterationPlan) -> IterationResult | EngineFailure:
        try:
            return self.engine.step(plan)
        except PlanFault as fault:  # the scheduler retries the plan's pieces apart (`fault_isolation`)
            logger.warning("engine %s: step %d failed (%s); its pieces are retried apart", self.engine_id,
                           plan.step_id, fault)
            self._stats.failures += 1
            return EngineFailure(step_id=plan.step_id, message=str(fault), isolatable=True)
        except Exception as error:  # noqa: BLE001 - reported to the scheduler, which fails the plan
            logger.exception("engine %s: step %d failed", self.engine_id, plan.step_id)
            self._stats.failures += 1
            return EngineFailure(step_id=plan.step_id, message=fault_text(error))
