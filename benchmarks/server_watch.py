"""What a benchmark sees of a running server from the outside: the resident memory of its processes
(the server and every process it started, summed; sampled every 0.5 s) and /health (polled every 0.2 s
from a process of its own, so that the benchmark's threads do not slow the poll: failures and the slowest
answer)."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

SLOW_S = 0.5  # a /health answer slower than this is kept with its time (`slow_polls`)
# The poller: one line per poll, "<1 if answered 200 else 0> <seconds> <its start, time.monotonic()>" (the
# system's monotonic clock: the same in every process), until its stdin closes.
POLLER = """
import sys, threading, time, httpx
url, done = sys.argv[1], threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
with httpx.Client(timeout=30) as http:
    while not done.wait(0.2):
        start = time.monotonic()
        try:
            ok = http.get(url).status_code == 200
        except httpx.HTTPError:
            ok = False
        print(int(ok), time.monotonic() - start, start, flush=True)
"""


def _children(pid: int) -> list[tuple[int, int]]:
    """`pid` and its descendants, each with its parent (from /proc: each process's parent)."""
    parents: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone meanwhile
        parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [(pid, 0)]
    while todo:
        current, parent = todo.pop()
        found.append((current, parent))
        todo += [(child, current) for child in parents.get(current, [])]
    return found


def _cmdline(pid: int) -> bytes | None:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None


def tree_rss_mb(pid: int) -> float:
    """The resident memory of `pid` and its descendants, in MB. A child that runs its parent's command line
    is a fork not yet exec'd (`subprocess` vforks): it shares its parent's memory, which is counted once
    (summed twice, a server of 1 GB starting a sandbox read as a 2 GB peak)."""
    total_kb = 0
    for child, parent in _children(pid):
        if parent and _cmdline(child) == _cmdline(parent):
            continue
        try:
            status = Path(f"/proc/{child}/status").read_text()
        except OSError:
            continue
        total_kb += next((int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:")), 0)
    return total_kb / 1024


class ServerWatch:
    """Samples a server's memory and health in two threads until `stop`.

    Args:
        pid: the server's process id.
        url: its root URL (`http://127.0.0.1:PORT`).
    """

    def __init__(self, pid: int, url: str) -> None:
        self._pid, self._url = pid, url
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._peak = 0.0
        self._polls, self._failures, self._slowest = 0, 0, 0.0
        self._slow: list[tuple[float, float]] = []  # (start, seconds) of the polls over SLOW_S
        self._poller = subprocess.Popen([sys.executable, "-c", POLLER, f"{url}/health"], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, text=True)
        self._threads = [threading.Thread(target=self._sample_memory, daemon=True),
                         threading.Thread(target=self._read_health, daemon=True)]
        for thread in self._threads:
            thread.start()

    def mark(self) -> float:
        """Start a new peak here; returns the memory now (MB)."""
        now = tree_rss_mb(self._pid)
        with self._lock:
            self._peak = now
        return round(now)

    def peak_since_mark(self) -> float:
        with self._lock:
            return round(self._peak)

    def health(self) -> dict[str, Any]:
        with self._lock:
            return {"polls": self._polls, "failures": self._failures, "slowest_ms": round(self._slowest * 1000)}

    def slow_polls(self) -> list[tuple[float, float]]:
        """(start on `time.monotonic()`'s clock, seconds) of each poll slower than `SLOW_S`."""
        with self._lock:
            return list(self._slow)

    def stop(self) -> None:
        self._stop.set()
        assert self._poller.stdin is not None
        self._poller.stdin.close()
        self._poller.wait(timeout=60)
        for thread in self._threads:
            thread.join()

    def _sample_memory(self) -> None:
        while not self._stop.wait(0.5):
            now = tree_rss_mb(self._pid)
            with self._lock:
                self._peak = max(self._peak, now)

    def _read_health(self) -> None:
        assert self._poller.stdout is not None
        for line in self._poller.stdout:
            ok, seconds, start = line.split()
            with self._lock:
                self._polls += 1
                self._failures += ok != "1"
                self._slowest = max(self._slowest, float(seconds))
                if float(seconds) > SLOW_S:
                    self._slow.append((float(start), float(seconds)))
