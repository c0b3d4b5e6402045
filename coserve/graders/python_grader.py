"""`python` graders, off unless the operator turns them on (`coserve serve --enable-python-graders`).

Each sample is graded by `python_sandbox.py` in a fresh bubblewrap sandbox (`sandbox_command.py`: its own
mount, PID, network, IPC and UTS namespaces, a read-only system and interpreter and nothing else of the
host, an unprivileged uid without capabilities, the seccomp filter of `seccomp_filter.py`, a bounded tmpfs
as its only writable place) under rlimits on address space, CPU seconds, file size, open files and
processes. The parent kills bubblewrap at the wall-clock limit; with it goes the sandbox's PID namespace
and every process in it. At most `concurrency` sandboxes run at once, shared fairly between tenants
(`fair_slots.FairSlots`). docs/graders.md says what this guarantees and what it does not.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from coserve.graders.fair_slots import FairSlots, GradersBusy, Lease
from coserve.graders.sandbox_command import SandboxHost, SandboxUnavailable, bwrap_argv
from coserve.graders.seccomp_filter import SeccompUnavailable, seccomp_program

__all__ = ["GradersBusy", "PythonGraderRunner", "PythonLimits", "PythonOutcome", "SandboxUnavailable"]

SANDBOX = Path(__file__).with_name("python_sandbox.py")
DETAIL_CHARS = 2000
RESULT_BYTES = 64 << 10  # the most of the result file read back
# A limit the child met as a Python exception (the others end the process: `_signal_reason`).
LIMIT_MARKERS = (("MemoryError", "memory"), ("[Errno 27] File too large", "file_size"))
# Install paths never shown to a tenant: the interpreter's and the server's.
_HIDDEN = tuple(sorted({sys.prefix, sys.base_prefix, os.path.realpath(sys.base_prefix),
                        str(Path(__file__).resolve().parents[2])}, key=len, reverse=True))


@dataclass(frozen=True, slots=True)
class PythonLimits:
    """What one grading may use."""

    timeout_s: float = 10.0  # wall clock
    cpu_s: float = 10.0
    memory_bytes: int = 1 << 30  # address space
    file_bytes: int = 16 << 20  # each file it writes, its prints included
    processes: int = 32  # processes and threads of its uid at once
    tmpfs_bytes: int = 64 << 20  # its /tmp, all files together


@dataclass(frozen=True, slots=True)
class PythonOutcome:
    """A reward, or why there is none: `runtime_error` (the grader's own failure) or `server_error` (it
    was stopped: `error_type` says by what), with details for the event or the answer."""

    reward: float | None
    runtime_error: bool = False
    server_error: bool = False
    error_type: str | None = None
    details: str | None = None


class PythonGraderRunner:
    """Runs `grade(sample, item)` of a python grader's source in the sandbox (module docstring).

    Args:
        limits: what one grading may use.
        concurrency: sandboxes at once (`slots`, shared fairly between tenants).
        first_uid: as root, the sandbox of slot i runs as uid and gid `first_uid + i` (ids no one else
            uses, so that the process limit counts only that sandbox's processes).
    """

    def __init__(self, limits: PythonLimits | None = None, concurrency: int = 2, first_uid: int = 60000) -> None:
        self.limits = limits or PythonLimits()
        self.slots = FairSlots(concurrency)
        self._first_uid = first_uid
        self._host: SandboxHost | None = None

    @property
    def concurrency(self) -> int:
        return self.slots.slots

    def check(self) -> SandboxHost:
        """This machine's sandbox; SandboxUnavailable names what to install (bubblewrap, libseccomp)."""
        if self._host is None:
            host = SandboxHost.find()
            try:
                seccomp_program()
            except SeccompUnavailable as err:
                raise SandboxUnavailable(str(err)) from None
            self._host = host
        return self._host

    def run(self, source: str, sample: dict[str, Any], item: dict[str, Any], *, tenant: str = "",
            lease: Lease | None = None, wait: bool = True) -> PythonOutcome:
        """The outcome of one grading, in a slot of `tenant`: `lease` (one the caller holds) or one taken
        here (`wait=False`: `GradersBusy` at once when the tenant gets none)."""
        try:
            host = self.check()
        except SandboxUnavailable as err:
            return PythonOutcome(None, server_error=True, error_type="sandbox_unavailable", details=str(err))
        held = lease or self.slots.acquire(tenant, None if wait else 0.0)
        try:
            return self._graded(host, held.slot, json.dumps({"source": source, "sample": sample, "item": item}))
        finally:
            if lease is None:
                self.slots.release(held)

    def _graded(self, host: SandboxHost, slot: int, request: str) -> PythonOutcome:
        with tempfile.TemporaryDirectory(prefix="coserve-grader-") as tmp:
            folder = Path(tmp)
            with open(folder / "stdout.txt", "wb") as out, open(folder / "stderr.txt", "wb") as err, \
                    open(folder / "result.json", "w+b") as result:
                status = self._child(host, slot, request, out, err, result)
                result.seek(0)
                written = result.read(RESULT_BYTES)
            return self._outcome(folder, status, written)

    def _child(self, host: SandboxHost, slot: int, request: str, out: BinaryIO, err: BinaryIO,
               result: BinaryIO) -> int | None:
        """bubblewrap's exit status; None when it ran past the wall-clock limit (then killed, and with it
        the sandbox's PID namespace)."""
        privileged = os.geteuid() == 0
        settings = {"memory_bytes": self.limits.memory_bytes, "file_bytes": self.limits.file_bytes,
                    "cpu_s": self.limits.cpu_s, "processes": self.limits.processes,
                    "uid": self._first_uid + slot if privileged else None, "result_fd": result.fileno()}
        seccomp = os.memfd_create("coserve-grader-seccomp")
        try:
            os.write(seccomp, seccomp_program())
            os.lseek(seccomp, 0, os.SEEK_SET)
            argv = bwrap_argv(host, seccomp_fd=seccomp, tmpfs_bytes=self.limits.tmpfs_bytes, privileged=privileged,
                              command=["-I", "-S", "-c", SANDBOX.read_text(), json.dumps(settings)])
            child = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=out, stderr=err, cwd="/",
                                     env={"PATH": "/usr/bin:/bin"}, start_new_session=True,
                                     pass_fds=(seccomp, result.fileno()))
        finally:
            os.close(seccomp)
        try:
            child.communicate(request.encode(), timeout=self.limits.timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
            return None
        return child.returncode

    def _outcome(self, folder: Path, status: int | None, written: bytes) -> PythonOutcome:
        if status is None:
            return PythonOutcome(None, server_error=True, error_type="timeout",
                                 details=f"the grader ran past {self.limits.timeout_s:g} s and was stopped")
        try:
            result = json.loads(written)
            if not isinstance(result, dict):
                raise ValueError("not an object")
        except ValueError:
            tail = _hidden(_tail(folder / "stderr.txt"))
            why = _signal_reason(status)
            return PythonOutcome(None, server_error=True, error_type=why,
                                 details=f"the grader's process ended ({why}) without a result"
                                         + (f": {tail.strip()}" if tail.strip() else ""))
        reward = _finite(result.get("reward"))
        if reward is None:
            detail = _hidden(str(result.get("error", "no finite reward"))[-DETAIL_CHARS:])
            limit = next((kind for marker, kind in LIMIT_MARKERS if marker in detail), None)
            return PythonOutcome(None, runtime_error=limit is None, server_error=limit is not None,
                                 error_type=limit, details=detail)
        return PythonOutcome(reward)


def _finite(value: Any) -> float | None:
    """The result file's reward as a finite float (the grader can write that file itself: trust nothing)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        reward = float(value)
    except OverflowError:
        return None
    return reward if math.isfinite(reward) else None


def _tail(path: Path) -> str:
    with open(path, "rb") as text:
        text.seek(max(0, path.stat().st_size - DETAIL_CHARS))
        return text.read().decode(errors="replace")


def _hidden(text: str) -> str:
    """`text` without the install paths of the interpreter and the server."""
    for path in _HIDDEN:
        text = text.replace(path, "<install>")
    return text


def _signal_reason(status: int) -> str:
    """Why the sandbox ended: bubblewrap exits with 128 + N when the grader's process died of signal N."""
    if status > 128:
        status = 128 - status
    if status == -signal.SIGXCPU or status == -signal.SIGKILL:
        return "cpu_time"
    if status == -signal.SIGXFSZ:
        return "file_size"
    if status < 0:
        return f"signal {-status}"
    return f"exit status {status}"
