"""`FairPool`: worker threads that grade for several tenants, fairly. Each task belongs to a tenant; a
free thread takes the oldest task of the tenant that has used the least grading time, among tenants
running fewer than `per_tenant` tasks (`fair_queue.FairQueue`; by default all threads but one, so that a
tenant arriving behind another's long batch starts on the next thread to come free, not after the batch).
A task's callers wait on its `Future` (`asyncio.wrap_future` on the event loop: no thread held while it
queues). The threads are daemons, started with the first task.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar

from coserve.graders.fair_queue import FairQueue
from coserve.graders.fair_slots import GradersBusy

R = TypeVar("R")


@dataclass(eq=False, slots=True)
class _Task:
    future: Future[Any]
    call: Callable[[], Any]


class FairPool:
    """`threads` grading threads shared between tenants (module docstring); `max_queued`: the most tasks
    one tenant may have waiting (more: `GradersBusy`; None: no bound)."""

    def __init__(self, threads: int, per_tenant: int | None = None, max_queued: int | None = None,
                 name: str = "coserve-grading") -> None:
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        self._threads, self._name, self._max_queued = threads, name, max_queued
        self._queue: FairQueue[_Task] = FairQueue(per_tenant or max(1, threads - 1))
        self._ready = threading.Condition()
        self._started = False
        self._closed = False

    def submit(self, tenant: str, fn: Callable[..., R], /, *args: Any, **kwargs: Any) -> Future[R]:
        """Run `fn(*args, **kwargs)` for `tenant`; its future has the result or the exception."""
        future: Future[R] = Future()
        with self._ready:
            if self._closed:
                raise RuntimeError("the grading pool is shut down")
            if self._max_queued is not None and self._queue.waiting(tenant) >= self._max_queued:
                raise GradersBusy(f"{self._max_queued} gradings of this tenant are already waiting")
            self._queue.push(tenant, _Task(future, lambda: fn(*args, **kwargs)))
            if not self._started:
                self._started = True
                for i in range(self._threads):
                    threading.Thread(target=self._work, name=f"{self._name}-{i}", daemon=True).start()
            self._ready.notify()
        return future

    def shutdown(self, wait: bool = True, cancel_futures: bool = False) -> None:
        """No new tasks; `cancel_futures`: the waiting ones are cancelled. The threads end once idle
        (`wait` is accepted for `Executor`'s signature: they are daemons, never joined)."""
        with self._ready:
            self._closed = True
            while cancel_futures and (picked := self._pop_any()) is not None:
                picked.future.cancel()
            self._ready.notify_all()

    def _pop_any(self) -> _Task | None:
        picked = self._queue.pop()
        if picked is None:
            return None
        self._queue.done(picked[0], 0.0)
        return picked[1]

    def _work(self) -> None:
        while True:
            with self._ready:
                picked = self._queue.pop()
                while picked is None:
                    if self._closed:
                        return
                    self._ready.wait()
                    picked = self._queue.pop()
            tenant, task = picked
            start = time.monotonic()
            if task.future.set_running_or_notify_cancel():
                try:
                    task.future.set_result(task.call())
                except BaseException as err:  # noqa: BLE001 - the task's failure goes to its future
                    task.future.set_exception(err)
            with self._ready:
                self._queue.done(tenant, time.monotonic() - start)
                self._ready.notify_all()
