"""Whether llguidance can enforce a spec, asked in worker processes under a memory and time budget.

The sizes of a spec are bounded when it is made (`coserve.contract.schema_limits`); this is the budget
for what those bounds miss. Each check runs in a `check_worker` process whose address space is capped
(`CheckBudget.memory_bytes`) and which is killed after `CheckBudget.timeout_s`: a spec that exceeds
either is refused ("the schema is too large to enforce"), the worker is replaced, and nothing else in
the server notices. A few workers (`CheckBudget.workers`) serve the threads that ask; answers are
remembered per spec (an LRU), a timeout for a minute only, since a busy machine may slow a check that
fits. `check_async` runs the check off the event loop: a slow check costs its sender, not /health.
"""

from __future__ import annotations

import asyncio
import enum
import json
import logging
import select
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import IO, Any

from coserve.contract.structured_output import StructuredOutput, StructuredOutputError

logger = logging.getLogger(__name__)

_START_TIMEOUT_S = 60.0  # a worker's interpreter start (not part of any check's budget)
_TIMEOUT_REMEMBERED_S = 60.0
_CHECKS_PER_WORKER = 1000  # then a fresh one: what llguidance keeps between checks never adds up


@dataclass(frozen=True, slots=True)
class CheckBudget:
    """What one check may cost: address space of its worker, seconds, and how many run at once."""

    memory_bytes: int = 512 << 20  # a worker is ~30 MB; the largest schema within the limits ~60 MB
    timeout_s: float = 5.0  # the slowest schema within the limits: ~0.2 s
    workers: int = 2


@dataclass(frozen=True, slots=True)
class _Answer:
    error: str | None
    expires: float | None = None  # monotonic time after which it is asked again (timeouts)


class _Failure(enum.Enum):
    DIED = "died"  # over the memory budget (or killed by something else)
    TIMED_OUT = "timed out"


class _Worker:
    """One `check_worker` process, asked one spec at a time."""

    def __init__(self, memory_bytes: int) -> None:
        self._proc = subprocess.Popen([sys.executable, "-m", "coserve.structured.check_worker", str(memory_bytes)],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        stdin, stdout = self._proc.stdin, self._proc.stdout
        assert stdin is not None and stdout is not None  # both are pipes (PIPE above)
        self._stdin: IO[bytes] = stdin
        self._stdout: IO[bytes] = stdout
        if not isinstance(self._read(_START_TIMEOUT_S), dict):
            self.kill()
            raise RuntimeError("the grammar check's worker did not start")
        self.checks = 0

    def ask(self, spec: StructuredOutput, timeout_s: float) -> dict[str, Any] | _Failure:
        """The worker's answer, or how it failed (it is then killed)."""
        request = json.dumps({"format": spec.format.value, "text": spec.schema_json}) + "\n"
        self.checks += 1
        try:
            self._stdin.write(request.encode("utf-8", "surrogatepass"))
            self._stdin.flush()
        except OSError:  # a broken pipe: it died
            answer: dict[str, Any] | _Failure = _Failure.DIED
        else:
            answer = self._read(timeout_s)
        if isinstance(answer, _Failure):
            self.kill()
        return answer

    def _read(self, timeout_s: float) -> dict[str, Any] | _Failure:
        ready, _, _ = select.select([self._stdout], [], [], timeout_s)
        if not ready:
            return _Failure.TIMED_OUT
        line = self._stdout.readline()
        return json.loads(line) if line else _Failure.DIED

    def kill(self) -> None:
        self._proc.kill()
        self._proc.wait()
        for stream in (self._stdin, self._stdout):
            stream.close()


class GrammarCheck:
    """Checks specs for one gateway (or one offline `LLM`); thread-safe.

    Args:
        budget: what one check may cost.
        cache_size: specs whose answer is remembered.
    """

    def __init__(self, budget: CheckBudget = CheckBudget(), cache_size: int = 256) -> None:
        self.budget = budget
        self._cache_size = cache_size
        self._cache: OrderedDict[StructuredOutput, _Answer] = OrderedDict()
        self._idle: list[_Worker] = []
        self._workers = threading.Condition()  # guards _idle and _started
        self._started = 0
        self._closed = False

    def check(self, spec: StructuredOutput) -> None:
        """Raise `StructuredOutputError` saying why `spec` cannot be enforced; return if it can."""
        error = self.error(spec)
        if error is not None:
            raise StructuredOutputError(error)

    async def check_async(self, spec: StructuredOutput) -> None:
        """`check`, in a thread when the answer is not remembered."""
        if self._remembered(spec) is None:
            await asyncio.get_running_loop().run_in_executor(None, self.error, spec)
        self.check(spec)

    def error(self, spec: StructuredOutput) -> str | None:
        """Why `spec` cannot be enforced, or None."""
        answer = self._remembered(spec)
        if answer is None:
            answer = self._ask(spec)
            with self._workers:
                self._cache[spec] = answer
                while len(self._cache) > self._cache_size:
                    self._cache.popitem(last=False)
        return answer.error

    def close(self) -> None:
        """Stop the workers; a busy one stops when its check ends."""
        with self._workers:
            self._closed = True
            idle, self._idle = self._idle, []
        for worker in idle:
            worker.kill()

    def _remembered(self, spec: StructuredOutput) -> _Answer | None:
        with self._workers:
            answer = self._cache.get(spec)
            if answer is None or (answer.expires is not None and answer.expires < time.monotonic()):
                return None
            self._cache.move_to_end(spec)
            return answer

    def _ask(self, spec: StructuredOutput) -> _Answer:
        worker = self._take_worker()
        reply = worker.ask(spec, self.budget.timeout_s)
        keep = not isinstance(reply, _Failure) and worker.checks < _CHECKS_PER_WORKER
        with self._workers:
            keep = keep and not self._closed
            if keep:
                self._idle.append(worker)
            else:
                self._started -= 1
            self._workers.notify()
        if isinstance(reply, _Failure):
            return self._refusal(spec, reply)
        if not keep:
            worker.kill()
        return _Answer(reply["error"])

    def _refusal(self, spec: StructuredOutput, failure: _Failure) -> _Answer:
        budget = self.budget
        if failure is _Failure.TIMED_OUT:
            why, expires = f"takes more than {budget.timeout_s:g} s", time.monotonic() + _TIMEOUT_REMEMBERED_S
        else:
            why, expires = f"needs more than {budget.memory_bytes >> 20} MiB", None
        logger.warning("grammar check: a %d-byte %s spec was refused: compiling it %s", len(spec.schema_json),
                       spec.format.value, why)
        return _Answer(f"the schema is too large to enforce: compiling it {why}", expires)

    def _take_worker(self) -> _Worker:
        with self._workers:
            while not self._idle and self._started >= self.budget.workers:
                self._workers.wait()
            if self._idle:
                return self._idle.pop()
            self._started += 1
        try:
            return _Worker(self.budget.memory_bytes)
        except BaseException:
            with self._workers:
                self._started -= 1
                self._workers.notify()
            raise
