"""`python` graders in their limited child process: a reward, the grader's own failures, and what it may
not do (loop, sleep, allocate, open a socket, start a process), each stopped and reported, never a hang."""

from __future__ import annotations

import time

import pytest

from coserve.contract.grader import parse_grader
from coserve.graders.checks import check_grader
from coserve.graders.grading import grade
from coserve.graders.python_grader import PythonGraderRunner, PythonLimits

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
    outcome = runner.run(EXACT, SAMPLE, {"answer": "Paris"})
    assert outcome.network in ("network namespace", "user and network namespace", "audit hook only")


@pytest.mark.parametrize(("source", "words"), [
    ("def grade(sample, item):\n    raise ValueError('no answer')\n", "ValueError: no answer"),
    ("def grade(sample, item):\n    return 'high'\n", "not a finite number"),
    ("def grade(sample, item):\n    return float('nan')\n", "not a finite number"),
    ("x = 1\n", "defines no function grade"),
    ("def grade(sample, item) return 1\n", "SyntaxError"),
    ("import socket\ndef grade(sample, item):\n    socket.create_connection(('192.0.2.1', 80), timeout=5)\n",
     "may not use socket"),
    ("import subprocess\ndef grade(sample, item):\n    return subprocess.run(['true']).returncode\n",
     "may not use subprocess"),
    ("import os\ndef grade(sample, item):\n    os.system('true')\n", "may not use os.system"),
    ("import ctypes\ndef grade(sample, item):\n    ctypes.CDLL(None)\n", "may not use ctypes"),
])
def test_the_graders_failures_are_runtime_errors(runner: PythonGraderRunner, source: str, words: str) -> None:
    outcome = runner.run(source, SAMPLE, {})
    assert outcome.reward is None and outcome.runtime_error and words in (outcome.details or ""), outcome


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


def test_a_caller_that_would_not_wait_is_told_the_slots_are_busy() -> None:
    import threading

    from coserve.graders.python_grader import GradersBusy

    runner = PythonGraderRunner(PythonLimits(timeout_s=5.0, cpu_s=5.0), concurrency=1)
    slow = "import time\ndef grade(sample, item):\n    time.sleep(1.5)\n    return 1.0\n"
    busy = threading.Thread(target=runner.run, args=(slow, SAMPLE, {}))
    busy.start()
    time.sleep(0.5)  # the one slot is taken
    with pytest.raises(GradersBusy):
        runner.run(EXACT, SAMPLE, {"answer": "Paris"}, wait=False)
    assert runner.run(EXACT, SAMPLE, {"answer": "Paris"}).reward == 1.0  # waiting, it gets the slot
    busy.join()
