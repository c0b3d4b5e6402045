"""`DataDirLock`: one holder per data dir, named to whoever is refused, released by `release` or by the
holder's death (a SIGKILLed process leaves no stale lock)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from coserve.actors.data_dir_lock import LOCK_FILE, DataDirLock, DataDirLocked

HOLD = ("import sys, time\n"
        "from coserve.actors.data_dir_lock import DataDirLock\n"
        "DataDirLock.acquire(sys.argv[1])\n"
        "print('locked', flush=True)\n"
        "time.sleep(600)\n")


def _holder(data_dir: Path) -> subprocess.Popen:
    """A process that takes the lock and keeps it (until killed)."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(data_dir)], stdout=subprocess.PIPE, text=True,
                            env=env)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "locked"
    return proc


def test_a_second_lock_is_refused_naming_the_dir_and_the_holder(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    with DataDirLock.acquire(data_dir) as lock:
        assert lock.held and (data_dir / LOCK_FILE).is_file()
        # Two opens in one process conflict too: the same process cannot serve a dir twice.
        with pytest.raises(DataDirLocked) as refused:
            DataDirLock.acquire(data_dir)
        assert refused.value.data_dir == data_dir.resolve()
        assert refused.value.holder.startswith(f"pid {os.getpid()} on host {socket.gethostname()} since ")
        assert str(data_dir.resolve()) in str(refused.value) and f"pid {os.getpid()}" in str(refused.value)
        with pytest.raises(DataDirLocked):
            DataDirLock.check_free(data_dir)
    assert not lock.held
    DataDirLock.check_free(data_dir)  # released: free again
    DataDirLock.acquire(data_dir).release()
    lock.release()  # a second release does nothing


def test_another_process_holds_it_until_it_is_killed(tmp_path: Path) -> None:
    proc = _holder(tmp_path)
    try:
        with pytest.raises(DataDirLocked, match=f"pid {proc.pid} on host"):
            DataDirLock.acquire(tmp_path)
        start = time.monotonic()
        with pytest.raises(DataDirLocked):
            DataDirLock.acquire(tmp_path, wait_s=0.5)  # waits, then gives up
        assert time.monotonic() - start >= 0.5
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    # The holder died without releasing anything: its lock went with it (no stale-lock cleanup).
    with DataDirLock.acquire(tmp_path) as lock:
        assert lock.held


def test_a_waiting_acquire_gets_the_lock_its_holder_gives_up(tmp_path: Path) -> None:
    proc = _holder(tmp_path)
    killer = subprocess.Popen([sys.executable, "-c", f"import os, time; time.sleep(0.5); os.kill({proc.pid}, 9)"])
    try:
        with DataDirLock.acquire(tmp_path, wait_s=30) as lock:  # the handover of a replaced Ray replica
            assert lock.held
    finally:
        killer.wait()
        proc.kill()
        proc.wait()
