"""One server per data dir: an exclusive lock on `<data-dir>/.lock`, held by the process that owns the jobs.

Two servers on one data dir would both resume the same running jobs, write the same adapters and events,
and the second would report a false "Resumed". The lock is `fcntl.flock` on `<data-dir>/.lock`: the OS
drops it when the holding process ends, however it ends (SIGKILL, a crash, a lost node's process), so a
stale lock needs no cleanup. The holder writes its pid, host and start time into the file only so that a
refused server can name it; the lock itself is the flock, never the file's content.

flock belongs to an open file description: a second `open` of the file in the same process conflicts with
the first. So a server takes the lock once and hands the `DataDirLock` to whoever owns the jobs (`coserve
serve --local`: `build_local_app` takes it before loading the model, the SchedulerActor keeps it); on Ray
the SchedulerActor takes it in its own process, and `coserve serve` only checks (`check_free`) that it is
free before starting Ray. Standard library only.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from datetime import datetime, timezone
from pathlib import Path

LOCK_FILE = ".lock"
RETRY_INTERVAL_S = 0.2


class DataDirLocked(RuntimeError):
    """Another process holds the data dir's lock: another coserve server serves it.

    Attributes:
        data_dir: the data dir (absolute).
        holder: who holds the lock, as its lock file says (`pid 123 on host h since ...`).
    """

    def __init__(self, data_dir: Path, holder: str) -> None:
        super().__init__(f"data dir {data_dir} is in use by another coserve server ({holder}); stop that "
                         f"server or give this one another data dir")
        self.data_dir, self.holder = data_dir, holder


class DataDirLock:
    """The exclusive lock on a data dir, held until `release` (or the process ends).

    Build it with `DataDirLock.acquire`.
    """

    def __init__(self, data_dir: Path, fd: int) -> None:
        self.data_dir = data_dir
        self._fd: int | None = fd

    @classmethod
    def acquire(cls, data_dir: str | Path, wait_s: float = 0.0) -> DataDirLock:
        """Lock `data_dir` (created if missing) for this process and write this process into its lock file.

        Args:
            wait_s: how long to keep trying while another process holds it (0: fail at once).

        Raises:
            DataDirLocked: another process (or another lock object of this one) still holds it.
            OSError: the lock file cannot be opened or locked (permissions, a filesystem without locks).
        """
        path = Path(data_dir).resolve()
        path.mkdir(parents=True, exist_ok=True)
        fd = os.open(path / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    holder = _describe_holder(fd)
                    os.close(fd)
                    raise DataDirLocked(path, holder) from None
                time.sleep(RETRY_INTERVAL_S)
            except BaseException:
                os.close(fd)
                raise
        since = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        record = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": since}).encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, record + b"\n", 0)
        return cls(path, fd)

    @classmethod
    def check_free(cls, data_dir: str | Path) -> None:
        """Raise `DataDirLocked` now if another process holds `data_dir`'s lock (take it and give it back:
        for a process that starts the lock's real holder elsewhere, e.g. `coserve serve` on Ray)."""
        cls.acquire(data_dir).release()

    @property
    def held(self) -> bool:
        """Whether this object still holds the lock."""
        return self._fd is not None

    def release(self) -> None:
        """Give the lock back (closing the file releases the flock); a second call does nothing."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            os.ftruncate(fd, 0)  # no holder named any more (a stale name would only mislead)
        finally:
            os.close(fd)

    def __enter__(self) -> DataDirLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _describe_holder(fd: int) -> str:
    """`pid P on host H since T`, from the lock file the holder wrote ("holder unknown" if unreadable)."""
    try:
        raw = json.loads(os.pread(fd, 4096, 0).decode("utf-8"))
        return f"pid {int(raw['pid'])} on host {raw['host']} since {raw['since']}"
    except (OSError, ValueError, KeyError, TypeError):  # being written, or not ours: say so, do not guess
        return "holder unknown: its lock file names no process yet"
