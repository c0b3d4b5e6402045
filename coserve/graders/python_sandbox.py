"""The child process of a `python` grader: run as `python -I python_sandbox.py LIMITS_JSON` by
`python_grader.PythonGraderRunner`, in an empty temporary directory, stdin the grader's source, the sample
and the item as JSON. Standard library only: it imports nothing of coserve.

Before the grader's code runs, this process, single-threaded:
1. caps itself with `resource.setrlimit`: address space, CPU seconds, file size, open files, no core;
2. leaves the host's network: `unshare(CLONE_NEWNET)` (root or CAP_SYS_ADMIN), else
   `unshare(CLONE_NEWUSER | CLONE_NEWNET)` (unprivileged user namespaces); in a new network namespace
   there is only a loopback interface, down, so no address outside the process can be reached;
3. installs an audit hook (PEP 578) that refuses sockets, new processes (fork, exec, spawn, os.system)
   and ctypes, which also covers the case where the kernel allows neither namespace.
Then it calls the source's `grade(sample, item)` and writes `{"reward": x}` (or `{"error": ...}`) to
`result.json`; the grader's own prints go to the files the parent gave as stdout and stderr.
"""

import ctypes
import json
import math
import resource
import sys
import traceback
from typing import Any

CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000
BLOCKED_EVENTS = ("socket.", "subprocess.", "os.system", "os.exec", "os.posix_spawn", "os.fork", "os.forkpty",
                  "os.spawn", "pty.spawn", "ctypes.")


def _limit(limits: dict[str, Any]) -> None:
    for name, value in (("RLIMIT_AS", limits["memory_bytes"]), ("RLIMIT_FSIZE", limits["file_bytes"]),
                        ("RLIMIT_NOFILE", 64), ("RLIMIT_CORE", 0)):
        resource.setrlimit(getattr(resource, name), (value, value))
    cpu = int(math.ceil(limits["cpu_s"]))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))


def _leave_network() -> str:
    libc = ctypes.CDLL(None, use_errno=True)
    for flags, how in ((CLONE_NEWNET, "network namespace"), (CLONE_NEWUSER | CLONE_NEWNET,
                                                             "user and network namespace")):
        if libc.unshare(flags) == 0:
            return how
    return "audit hook only"


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if event.startswith(BLOCKED_EVENTS):
        raise PermissionError(f"a python grader may not use {event}")


def _write(result: dict[str, Any]) -> None:
    with open("result.json", "w") as out:
        json.dump(result, out)


def main() -> None:
    limits = json.loads(sys.argv[1])
    request = json.loads(sys.stdin.read())
    _limit(limits)
    network = _leave_network()
    sys.addaudithook(_audit)
    try:
        scope: dict[str, Any] = {"__name__": "grader"}
        exec(compile(request["source"], "<grader>", "exec"), scope)
        grade = scope.get("grade")
        if not callable(grade):
            _write({"error": "the source defines no function grade(sample, item)", "network": network})
            return
        reward = grade(request["sample"], request["item"])
    except BaseException:  # the grader's failure, reported as its runtime error
        _write({"error": traceback.format_exc(limit=-3)[-2000:], "network": network})
        return
    if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
        _write({"error": f"grade() returned {reward!r:.200}, not a finite number", "network": network})
        return
    _write({"reward": float(reward), "network": network})


if __name__ == "__main__":
    main()
