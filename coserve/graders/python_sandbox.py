"""The program of a python grader's sandbox (`sandbox_command.py` says what the sandbox is): run by
`python_grader.PythonGraderRunner` as `python -I -S -c <this file's text> SETTINGS_JSON` inside bubblewrap,
stdin the grader's source, the sample and the item as JSON. Standard library only: it imports nothing of
coserve (the sandbox does not show the server's packages).

Before the grader's code runs, this process, single-threaded:
1. when bubblewrap started it as root (the server runs as root), drops to the unprivileged uid and gid
   `uid` with no supplementary groups, which clears its capabilities;
2. caps itself with `resource.setrlimit`: address space, CPU seconds, file size, open files, processes
   (counted for its uid: only this sandbox's processes), no core.
Then it calls the source's `grade(sample, item)` and writes `{"reward": x}` or `{"error": ...}` to the file
descriptor `result_fd` (the parent's file); the grader's prints go to the parent's stdout and stderr files.
An error shows only the grader's own frames (`<grader>`), never the interpreter's install paths.
"""

import json
import linecache
import math
import os
import resource
import sys
import traceback
from typing import Any

DETAIL_CHARS = 2000


def _drop(uid: Any) -> None:
    if os.getuid() != 0:  # an unprivileged server: bubblewrap's user namespace already made it uid 65534
        return
    if not isinstance(uid, int) or uid <= 0:
        raise SystemExit("the sandbox runs as root and has no uid to drop to")
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)
    if os.getresuid() != (uid, uid, uid) or os.getresgid() != (uid, uid, uid) or os.getgroups():
        raise SystemExit("the sandbox could not drop its privileges")


def _limit(settings: dict[str, Any]) -> None:
    for name, value in (("RLIMIT_AS", settings["memory_bytes"]), ("RLIMIT_FSIZE", settings["file_bytes"]),
                        ("RLIMIT_NOFILE", 64), ("RLIMIT_CORE", 0), ("RLIMIT_NPROC", settings["processes"])):
        resource.setrlimit(getattr(resource, name), (value, value))
    cpu = int(math.ceil(settings["cpu_s"]))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))


def _error(err: BaseException) -> str:
    """The grader's own frames and the exception, the interpreter's paths left out."""
    frames = [frame for frame in traceback.extract_tb(err.__traceback__) if frame.filename == "<grader>"]
    lines = ["Traceback (most recent call last):\n", *traceback.format_list(frames[-3:])] if frames else []
    text = "".join(lines + traceback.format_exception_only(type(err), err))
    for path in {sys.prefix, sys.base_prefix, sys.exec_prefix}:
        text = text.replace(path, "<python>")
    return text[-DETAIL_CHARS:]


def _reward(value: Any) -> dict[str, Any]:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return {"error": f"grade() returned {value!r:.200}, not a finite number"}
    try:
        reward = float(value)
    except OverflowError:
        return {"error": "grade() returned an integer too large for a float, not a finite number"}
    if not math.isfinite(reward):
        return {"error": f"grade() returned {reward!r}, not a finite number"}
    return {"reward": reward}


def _grade(request: dict[str, Any]) -> dict[str, Any]:
    source = request["source"]
    linecache.cache["<grader>"] = (len(source), None, source.splitlines(True), "<grader>")
    try:
        scope: dict[str, Any] = {"__name__": "grader"}
        exec(compile(source, "<grader>", "exec"), scope)
        grade = scope.get("grade")
        if not callable(grade):
            return {"error": "the source defines no function grade(sample, item)"}
        return _reward(grade(request["sample"], request["item"]))
    except BaseException as err:  # noqa: BLE001 - the grader's failure, reported as its runtime error
        return {"error": _error(err)}


def main() -> None:
    settings = json.loads(sys.argv[1])
    request = json.loads(sys.stdin.read())
    _drop(settings["uid"])
    _limit(settings)
    result = json.dumps(_grade(request)).encode()
    while result:
        result = result[os.write(settings["result_fd"], result):]
    os._exit(0)  # threads the grader left running end with it


if __name__ == "__main__":
    main()
