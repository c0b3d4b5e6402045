"""`python` graders, off unless the operator turns them on (`coserve serve --enable-python-graders`).

Each sample is graded in a fresh child process (`python_sandbox.py`, under `python -I`: no user site,
no `PYTHON*` variables, the current directory not on the path) in an empty temporary directory that is
removed afterwards, with a minimal environment and its own session. The child caps its address space,
CPU seconds, file sizes and open files, leaves the host's network (a new network namespace where the
kernel allows one) and refuses sockets, new processes and ctypes with an audit hook before the grader's
code runs. The parent kills the whole session at the wall-clock limit. At most `concurrency` children run
at once. What this does not give: the child runs as the server's user and can read whatever that user
can read (the files of the data dir included), and an audit hook is not a boundary against code that
finds a way around Python (docs/graders.md says the same).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

SANDBOX = Path(__file__).with_name("python_sandbox.py")
DETAIL_CHARS = 2000
# A limit the child met as a Python exception (the others end the process: `_signal_reason`).
LIMIT_MARKERS = (("MemoryError", "memory"), ("[Errno 27] File too large", "file_size"))


@dataclass(frozen=True, slots=True)
class PythonLimits:
    """What one grading may use."""

    timeout_s: float = 10.0  # wall clock
    cpu_s: float = 10.0
    memory_bytes: int = 1 << 30  # address space
    file_bytes: int = 16 << 20  # each file it writes, its prints included


@dataclass(frozen=True, slots=True)
class PythonOutcome:
    """A reward, or why there is none: `runtime_error` (the grader's own failure) or `server_error` (it
    was stopped: `error_type` says by what), with details for the event or the answer."""

    reward: float | None
    runtime_error: bool = False
    server_error: bool = False
    error_type: str | None = None
    details: str | None = None
    network: str | None = None  # how the child was cut off from the network


class GradersBusy(RuntimeError):
    """Every python grader slot is taken and the caller would not wait (`run(wait=False)`)."""


class PythonGraderRunner:
    """Runs `grade(sample, item)` of a python grader's source in a limited child process."""

    def __init__(self, limits: PythonLimits | None = None, concurrency: int = 2) -> None:
        self.limits = limits or PythonLimits()
        self._concurrency = concurrency
        self._slots = threading.BoundedSemaphore(concurrency)

    def run(self, source: str, sample: dict[str, Any], item: dict[str, Any], *, wait: bool = True) -> PythonOutcome:
        """The outcome of one grading. `wait=False`: raise `GradersBusy` at once rather than wait for a
        slot (an HTTP request must not hold a server thread for other clients' graders)."""
        if not self._slots.acquire(blocking=wait):
            raise GradersBusy(f"all {self.concurrency} python grader slots are busy")
        request = json.dumps({"source": source, "sample": sample, "item": item})
        try:
            with tempfile.TemporaryDirectory(prefix="coserve-grader-") as tmp:
                folder = Path(tmp)
                with open(folder / "stdout.txt", "wb") as out, open(folder / "stderr.txt", "wb") as err:
                    status = self._child(request, folder, out, err)
                return self._outcome(folder, status)
        finally:
            self._slots.release()

    @property
    def concurrency(self) -> int:
        return self._concurrency

    def _child(self, request: str, folder: Path, out: Any, err: Any) -> int | None:
        """The child's exit status; None when it ran past the wall-clock limit (its session killed)."""
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(folder), "OMP_NUM_THREADS": "1",
               "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        child = subprocess.Popen([sys.executable, "-I", str(SANDBOX), json.dumps(asdict(self.limits))],
                                 stdin=subprocess.PIPE, stdout=out, stderr=err, cwd=folder, env=env,
                                 start_new_session=True)
        try:
            child.communicate(request.encode(), timeout=self.limits.timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
            return None
        return child.returncode

    def _outcome(self, folder: Path, status: int | None) -> PythonOutcome:
        if status is None:
            return PythonOutcome(None, server_error=True, error_type="timeout",
                                 details=f"the grader ran past {self.limits.timeout_s:g} s and was stopped")
        try:
            result = json.loads((folder / "result.json").read_text())
        except (OSError, ValueError):
            tail = (folder / "stderr.txt").read_bytes()[-DETAIL_CHARS:].decode(errors="replace")
            why = _signal_reason(status)
            return PythonOutcome(None, server_error=True, error_type=why,
                                 details=f"the grader's process ended ({why}) without a result"
                                         + (f": {tail.strip()}" if tail.strip() else ""))
        network = result.get("network")
        if not isinstance(result.get("reward"), int | float):
            detail = str(result.get("error", "no reward"))[-DETAIL_CHARS:]
            limit = next((kind for marker, kind in LIMIT_MARKERS if marker in detail), None)
            return PythonOutcome(None, runtime_error=limit is None, server_error=limit is not None,
                                 error_type=limit, details=detail, network=network)
        return PythonOutcome(float(result["reward"]), network=network)


def _signal_reason(status: int) -> str:
    if status == -signal.SIGXCPU or status == -signal.SIGKILL:
        return "cpu_time"
    if status == -signal.SIGXFSZ:
        return "file_size"
    if status < 0:
        return f"signal {-status}"
    return f"exit status {status}"
