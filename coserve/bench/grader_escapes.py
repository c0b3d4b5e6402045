"""Python graders that try to break out of their sandbox (issue 45): each is the source of a `grade`
function, sent through `graders/run` with an `item` naming what it aims at (the server's pid and port, the
tenants file, the data dir, the store, an upload).

Every escape counts what worked and returns that count: 0.0 means it failed everywhere, so a sandbox that
let one through scores more than 0, and a grader that broke for another reason shows as a runtime error
(which is neither). The soak (benchmarks/soak_tenants.py) runs them in a loop beside a victim tenant; the
sandbox tests (tests/security/test_python_grader_sandbox.py) send each once.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

READ_SECRETS = (
    "import os\ndef grade(sample, item):\n    seen = 0\n    for path in item['paths']:\n"
    "        try:\n            os.listdir(path) if os.path.isdir(path) else open(path, 'rb').read()\n"
    "            seen += 1\n        except OSError:\n            pass\n    return seen\n")

WRITE_STORE = (
    "import sqlite3\ndef grade(sample, item):\n    try:\n"
    "        db = sqlite3.connect(item['store'])\n"
    "        db.execute(\"UPDATE files SET tenant = 'attacker'\")\n"
    "        db.execute(\"UPDATE models SET tenant = 'attacker'\")\n        db.commit()\n"
    "        return float(db.total_changes > 0)\n    except sqlite3.Error:\n        return 0.0\n")

# SIGSTOP froze the server before (os.kill is not audited); SIGKILL is sent only to the server's pid.
SIGNAL_SERVER = (
    "import os, signal\ndef grade(sample, item):\n    hits = 0\n"
    "    for pid in (os.getppid(), item['server'], 1, -1):\n"
    "        for sig in (signal.SIGSTOP, signal.SIGKILL):\n"
    "            if pid in (-1, 1, os.getppid()) and sig == signal.SIGKILL:\n                continue\n"
    "            try:\n                os.kill(pid, sig)\n                hits += pid == item['server']\n"
    "            except OSError:\n                pass\n    return float(hits)\n")

# The old audit hook's switch, then what it used to block: subprocess, ctypes and raw system calls.
NO_AUDIT_HOOK = (
    "import ctypes, os, subprocess, sys\ndef grade(sample, item):\n"
    "    sys.modules['__main__'].BLOCKED_EVENTS = ('x',)  # the old audit hook's switch\n"
    "    escaped = 0\n"
    "    cat = subprocess.run(['cat', item['tenants']], capture_output=True)\n"
    "    escaped += cat.returncode == 0\n"
    "    libc = ctypes.CDLL(None, use_errno=True)\n"
    "    escaped += libc.unshare(0x10000000 | 0x40000000) == 0  # a user and network namespace\n"
    "    escaped += libc.syscall(62, item['server'], 19) == 0  # kill(server, SIGSTOP), raw\n"
    "    fd = os.open('/proc/self/ns/net', os.O_RDONLY)  # its own: setns is refused whatever the target\n"
    "    escaped += libc.setns(fd, 0) == 0\n"
    "    escaped += libc.mount(b'none', b'/tmp', b'tmpfs', 0, None) == 0\n"
    "    escaped += libc.syscall(101, 0, 1, 0, 0) == 0  # ptrace(PTRACE_TRACEME)... of its parent\n"
    "    return float(escaped)\n")

NETWORK = (
    "import os, socket\ndef grade(sample, item):\n    reached = 0\n"
    "    for host in ('127.0.0.1', '0.0.0.0', 'localhost'):\n"
    "        try:\n            socket.create_connection((host, item['port']), timeout=2).close()\n"
    "            reached += 1\n        except OSError:\n            pass\n"
    "    reached += os.path.exists(f\"/proc/{item['server']}/ns/net\")\n    return float(reached)\n")


def setsid_grandchild(token: str, then: str = "pass") -> str:
    """A grader that starts a grandchild in its own session (`sleep <token>`, a number of seconds), waits
    until it runs (5 s at most), then does `then`; 0.0 when the grandchild ran (the escape is judged
    afterwards: whether a process with `token` in its command line outlives the grader), 0.5 when it
    never ran."""
    return ("import os, time\ndef grade(sample, item):\n    if os.fork() == 0:\n        os.setsid()\n"
            "        if os.fork() == 0:\n"
            f"            os.execv('/bin/sleep', ['sleep', {token!r}])\n        os._exit(0)\n"
            "    os.wait()\n    running = False\n"
            "    for _ in range(50):  # until it shows (a loaded machine takes a while)\n"
            "        running = any(b" + repr(token) + " in open(f'/proc/{p}/cmdline', 'rb').read()\n"
            "                      for p in os.listdir('/proc') if p.isdigit())\n"
            "        if running:\n            break\n        time.sleep(0.1)\n"
            f"    {then}\n    return 0.0 if running else 0.5\n")


@dataclass(frozen=True)
class EscapeTarget:
    """What the escapes aim at, on the server's host."""

    server_pid: int
    port: int
    tenants_file: str
    data_dir: str
    store: str
    secrets: tuple[str, ...]  # files and folders no grader may read (the tenants file, uploads, ...)


GRANDCHILD_TOKEN = "161.803"  # the setsid grandchild's `sleep` argument: how it is found on the host


def escapes(target: EscapeTarget) -> dict[str, tuple[str, dict[str, Any]]]:
    """Name -> (a python grader's source, the item it is graded with)."""
    return {
        "grader_reads_secrets": (READ_SECRETS, {"paths": list(target.secrets)}),
        "grader_writes_store": (WRITE_STORE, {"store": target.store}),
        "grader_signals_server": (SIGNAL_SERVER, {"server": target.server_pid}),
        "grader_audit_hook_off_subprocess_ctypes": (NO_AUDIT_HOOK, {"tenants": target.tenants_file,
                                                                    "server": target.server_pid}),
        "grader_network_to_server": (NETWORK, {"port": target.port, "server": target.server_pid}),
        "grader_setsid_grandchild": (setsid_grandchild(GRANDCHILD_TOKEN), {}),
    }


def alive(token: str) -> list[int]:
    """Host processes whose command line holds `token` (a grandchild that outlived its grader)."""
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if token.encode() in (proc / "cmdline").read_bytes():
                    found.append(int(proc.name))
            except OSError:
                pass
    return found
