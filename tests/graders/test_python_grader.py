"""`python` graders in their bubblewrap sandbox: a reward, the grader's own failures (only its own frames
shown), what the sandbox does not let it see or do, and each limit stopped and reported, never a hang.
The same escapes through the real server: tests/security/test_python_grader_sandbox.py."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from coserve.contract.grader import parse_grader
from coserve.graders.checks import check_grader
from coserve.graders.grading import grade
from coserve.graders.python_grader import GradersBusy, PythonGraderRunner, PythonLimits
from sandbox_support import require_sandbox

require_sandbox()

LIMITS = PythonLimits(timeout_s=3.0, cpu_s=1.0, memory_bytes=512 << 20)
SAMPLE = {"output_text": "Paris", "output_json": None}
EXACT = "def grade(sample, item):\n    return float(sample['output_text'] == item['answer'])\n"


@pytest.fixture(scope="module")
def runner() -> PythonGraderRunner:
    return PythonGraderRunner(LIMITS)


def test_a_grader_gets_the_sample_and_the_item(runner: PythonGraderRunner) -> None:
    assert runner.run(EXACT, SAMPLE, {"answer": "Paris"}).reward == 1.0
    assert runner.run(EXACT, SAMPLE, {"answer": "Lyon"}).reward == 0.0
    printing = runner.run("def grade(sample, item):\n    print('x' * 1000)\n    return 0.25\n", SAMPLE, {})
    assert printing.reward == 0.25  # its prints go to a file, not into the result
    stdlib = "import json, re, math\ndef grade(sample, item):\n    return math.sqrt(len(json.dumps(item))) / 10\n"
    assert runner.run(stdlib, SAMPLE, {"a": 10}).reward == pytest.approx(0.3)


@pytest.mark.parametrize(("source", "words"), [
    ("def grade(sample, item):\n    raise ValueError('no answer')\n", "ValueError: no answer"),
    ("def grade(sample, item):\n    return 'high'\n", "not a finite number"),
    ("def grade(sample, item):\n    return float('nan')\n", "not a finite number"),
    ("def grade(sample, item):\n    return 10 ** 400\n", "not a finite number"),
    ("x = 1\n", "defines no function grade"),
    ("def grade(sample, item) return 1\n", "SyntaxError"),
    ("import socket\ndef grade(sample, item):\n    socket.create_connection(('192.0.2.1', 80), timeout=5)\n",
     "Network is unreachable"),
    ("def grade(sample, item):\n    open('/x', 'w')\n", "Read-only file system"),
    ("import ctypes\ndef grade(sample, item):\n    libc = ctypes.CDLL(None, use_errno=True)\n"
     "    assert libc.unshare(0x10000000) == -1\n    raise OSError(ctypes.get_errno(), 'unshare refused')\n",
     "[Errno 1] unshare refused"),
])
def test_the_graders_failures_are_runtime_errors(runner: PythonGraderRunner, source: str, words: str) -> None:
    outcome = runner.run(source, SAMPLE, {})
    assert outcome.reward is None and outcome.runtime_error and words in (outcome.details or ""), outcome


def test_an_error_shows_only_the_graders_frames(runner: PythonGraderRunner) -> None:
    """A failure deep in the standard library: the details hold the grader's line, no install path."""
    source = "import json\ndef grade(sample, item):\n    return json.loads('{')\n"
    details = runner.run(source, SAMPLE, {}).details or ""
    assert 'File "<grader>", line 3, in grade' in details and "json.loads('{')" in details
    assert "JSONDecodeError" in details
    for path in {sys.prefix, sys.base_prefix, os.path.realpath(sys.base_prefix), "site-packages", "/work/"}:
        assert path not in details, details


def test_the_sandbox_shows_a_read_only_system_and_nothing_of_the_server(runner: PythonGraderRunner,
                                                                          tmp_path: os.PathLike[str]) -> None:
    secret = os.path.join(tmp_path, "secret.txt")
    with open(secret, "w") as out:
        out.write("sk-secret")
    allowed = {"usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32", "proc", "dev", "tmp",
               os.path.realpath(sys.base_prefix).split("/")[1]}
    source = (f"import os\ndef grade(sample, item):\n"
              f"    seen = [p for p in ({secret!r}, {os.getcwd()!r}, '/etc/passwd', '/home') if os.path.exists(p)]\n"
              f"    extra = set(os.listdir('/')) - {allowed!r}\n"
              "    procs = [p for p in os.listdir('/proc') if p.isdigit()]\n"
              "    assert not seen and not extra and len(procs) <= 3 and os.getuid() != 0, (seen, extra, procs)\n"
              "    return 1.0\n")
    outcome = runner.run(source, SAMPLE, {})
    assert outcome.reward == 1.0, outcome


@pytest.mark.parametrize(("source", "kind", "bound_s"), [
    ("def grade(sample, item):\n    while True:\n        pass\n", "cpu_time", 2.5),
    ("import time\ndef grade(sample, item):\n    time.sleep(60)\n", "timeout", 4.0),
    ("def grade(sample, item):\n    data = bytearray(4 << 30)\n    return 1.0\n", "memory", 2.0),
    ("def grade(sample, item):\n    open('big', 'wb').write(b'x' * (64 << 20))\n    return 1.0\n", "file_size", 2.0),
])
def test_what_exceeds_a_limit_is_stopped_and_reported(runner: PythonGraderRunner, source: str, kind: str,
                                                      bound_s: float) -> None:
    start = time.monotonic()
    outcome = runner.run(source, SAMPLE, {})
    assert outcome.reward is None and outcome.server_error and outcome.error_type == kind, outcome
    assert time.monotonic() - start < bound_s + 5.0  # generous: a loaded machine; the point is no hang


def test_a_fork_bomb_meets_the_process_limit(runner: PythonGraderRunner) -> None:
    source = ("import os\ndef grade(sample, item):\n    made = 0\n    try:\n        for _ in range(1000):\n"
              "            if os.fork() == 0:\n                import time; time.sleep(30); os._exit(0)\n"
              "            made += 1\n    except OSError:\n        pass\n    return made / 1000\n")
    outcome = runner.run(source, SAMPLE, {})
    assert outcome.reward is not None and 0 < outcome.reward * 1000 < LIMITS.processes, outcome


def test_off_unless_the_operator_turns_them_on_and_graded_with_flags(runner: PythonGraderRunner) -> None:
    grader = parse_grader({"type": "python", "name": "p", "source": EXACT})
    with pytest.raises(Exception, match="--enable-python-graders"):
        check_grader(grader)
    check_grader(grader, python=True)
    assert grade(grader, {"answer": "Paris"}, "Paris", runner).reward == 1.0
    broken = grade(parse_grader({"type": "python", "name": "p", "source": "def grade(s, i):\n    1 / 0\n"}),
                   {}, "Paris", runner)
    assert broken.reward == 0.0 and broken.errors.python_grader_runtime_error
    assert "ZeroDivisionError" in broken.errors.details[0]


def test_a_tenant_holds_at_most_its_share_of_the_slots() -> None:
    """Two slots: a tenant gets one at a time; another tenant gets the other at once."""
    runner = PythonGraderRunner(PythonLimits(timeout_s=5.0, cpu_s=5.0), concurrency=2)
    slow = "import time\ndef grade(sample, item):\n    time.sleep(1.5)\n    return 1.0\n"
    busy = threading.Thread(target=runner.run, args=(slow, SAMPLE, {}), kwargs={"tenant": "a"})
    busy.start()
    time.sleep(0.5)  # tenant a holds one slot
    with pytest.raises(GradersBusy):
        runner.run(EXACT, SAMPLE, {"answer": "Paris"}, tenant="a", wait=False)
    assert runner.run(EXACT, SAMPLE, {"answer": "Paris"}, tenant="b", wait=False).reward == 1.0
    assert runner.run(EXACT, SAMPLE, {"answer": "Paris"}, tenant="a").reward == 1.0  # waiting, it gets one
    busy.join()


def test_an_unprivileged_server_gets_the_same_sandbox() -> None:
    """The server as uid 65534 (the system's interpreter of this version, which that uid can read): bubblewrap
    adds a user namespace; the grader runs without capabilities, cannot make namespaces, meets its limits."""
    system = f"/usr/bin/python{sys.version_info.major}.{sys.version_info.minor}"
    if os.geteuid() != 0 or not os.path.exists(system):
        pytest.skip(f"needs root (to become uid 65534) and {system}")
    import subprocess
    import sysconfig

    env = {"PATH": "/usr/bin:/bin",
           "PYTHONPATH": f"{Path(__file__).resolve().parents[2]}:{sysconfig.get_paths()['purelib']}"}
    nobody: dict[str, Any] = {"user": 65534, "group": 65534, "extra_groups": [], "env": env, "cwd": "/",
                              "capture_output": True, "text": True, "timeout": 60}
    probe = subprocess.run([system, "-c", "import coserve.graders.python_grader"], **nobody)
    if probe.returncode != 0:
        pytest.skip(f"uid 65534 cannot import coserve from this checkout: {probe.stderr[-300:]}")
    program = ("import json\nfrom coserve.graders.python_grader import PythonGraderRunner, PythonLimits\n"
               "runner = PythonGraderRunner(PythonLimits(timeout_s=5.0, cpu_s=1.0))\n"
               "source = open(0).read()\n"
               "print(json.dumps([runner.run(source, {}, {}).reward,\n"
               "                  runner.run('def grade(s, i):\\n    while True: pass\\n', {}, {}).error_type]))\n")
    source = ("import ctypes, os\ndef grade(sample, item):\n    libc = ctypes.CDLL(None, use_errno=True)\n"
              "    status = dict(line.split(':', 1) for line in open('/proc/self/status').read().splitlines())\n"
              "    assert int(status['CapEff'], 16) == 0 and status['NoNewPrivs'].strip() == '1', status\n"
              "    assert libc.unshare(0x10000000) == -1 and not os.path.exists('/etc/passwd')\n"
              "    return os.getuid()\n")
    ran = subprocess.run([system, "-c", program], input=source, **nobody)
    assert ran.returncode == 0, ran.stderr[-2000:]
    assert json.loads(ran.stdout) == [65534.0, "cpu_time"], ran.stdout
