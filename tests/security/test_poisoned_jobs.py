"""The tenant boundary on fine-tuning (issue 45): an ATTACKER tenant uploads poisoned training files and starts
jobs on them, against a real server (`coserve serve --local` on the tiny llama, in a thread) with the official
`openai` client; a VICTIM tenant fine-tunes and chats meanwhile.

* Every poisoned upload (lone surrogates in each kind of row and in tool-call arguments, invalid UTF-8, an
  encoded surrogate, nesting 100,000 deep, NaN, a 5,000-digit number, a row over 2 MiB) is a 400 naming the
  line, and a large upload (16 MB) leaves `/health` fast.
* Files that pass upload but fail when the job is prepared (tools the model's template cannot render, behind
  300 rows that take seconds to tokenize; a reinforcement prompt longer than the context), and a job whose
  training diverges (`lora_alpha` 1e30): each fails its own job with OpenAI's `error` and a message. While
  the slow file is still being prepared, the victim's pause and cancel are applied and a job it starts
  after the attacker's runs to `succeeded`, and its model answers a chat.
* `/health` answers within 1 s throughout, and the server's memory stays bounded.
"""

from __future__ import annotations

import io
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import psutil
import pytest

from coserve.contract.training_jsonl import MAX_ROW_BYTES
from local_server import LocalServer, local_server, poll_job, upload_jsonl

ATTACKER, VICTIM = "sk-attacker-poison-0123456789", "sk-victim-poison-0123456789"
HEALTH_BOUND_S = 1.0
RSS_BOUND_MB = 600  # growth of the process (server and test) over a test
SLOW_ROWS = 300
LINES = [{"messages": [{"role": "user", "content": f"Say the number {i}"},
                       {"role": "assistant", "content": f"The number is {i}."}]} for i in range(12)]
USER, ANSWER = {"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}
PAIR = {"input": {"messages": [USER]}, "preferred_output": [ANSWER],
        "non_preferred_output": [{"role": "assistant", "content": "no"}]}
CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
GRADER = {"type": "string_check", "name": "s", "input": "{{ sample.output_text }}", "reference": "{{ item.answer }}",
          "operation": "eq"}


class Watch:
    """`/health` polled every 50 ms in a thread (its slowest answer), and the process's peak RSS."""

    def __init__(self, url: str) -> None:
        self._url, self._stop = url, threading.Event()
        self.slowest, self.failures, self.polls = 0.0, [], 0
        self._process = psutil.Process()
        self.rss_start = self.rss_peak = self._process.memory_info().rss
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        with httpx.Client(timeout=10) as http:
            while True:  # the first poll at once: a case may take less than the interval
                started = time.perf_counter()
                try:
                    status: object = http.get(f"{self._url}/health").status_code
                except httpx.HTTPError as error:
                    status = type(error).__name__
                self.slowest = max(self.slowest, time.perf_counter() - started)
                self.polls += 1
                self.rss_peak = max(self.rss_peak, self._process.memory_info().rss)
                if status != 200:
                    self.failures.append(status)
                if self._stop.wait(0.05):
                    return

    def check(self) -> None:
        self._stop.set()
        self._thread.join()
        assert self.polls > 0 and not self.failures, self.failures
        assert self.slowest < HEALTH_BOUND_S, f"/health took {self.slowest:.2f} s"
        grew = (self.rss_peak - self.rss_start) / 2**20
        print(f"/health: {self.polls} polls, slowest {self.slowest:.3f} s; the process grew {grew:.0f} MB")
        assert grew < RSS_BOUND_MB, f"the process grew {grew:.0f} MB"


@pytest.fixture(scope="module")
def server(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalServer]:
    tenants = {"attacker": {"api_keys": [ATTACKER]}, "victim": {"api_keys": [VICTIM]}}
    with local_server(llama_dir, tmp_path_factory.mktemp("poisoned-jobs"), tenants) as srv:
        yield srv


@pytest.fixture
def watch(server: LocalServer) -> Iterator[Watch]:
    watching = Watch(server.url)
    yield watching
    watching.check()


def _upload(oa: openai.OpenAI, data: bytes) -> str:
    return oa.files.create(file=("train.jsonl", io.BytesIO(data)), purpose="fine-tune").id


def _jsonl(*rows: Any) -> bytes:
    return "\n".join(json.dumps(row) for row in rows).encode()  # ensure_ascii: a lone surrogate as \\udxxx


OVER_LONG = {"messages": [{"role": "user", "content": "x" * MAX_ROW_BYTES}, ANSWER]}
POISONED_UPLOADS = {
    "chat lone surrogate": (_jsonl(LINES[0], {"messages": [{"role": "user", "content": "hi \ud800"}, ANSWER]}),
                            "Line 2: a lone surrogate (\\ud800) in messages[0].content"),
    "DPO lone surrogate": (_jsonl(PAIR, {**PAIR, "preferred_output": [{"role": "assistant", "content": "\udfff"}]}),
                           "Line 2: a lone surrogate (\\udfff) in preferred_output[0].content"),
    "reinforcement lone surrogate key": (_jsonl({"messages": [USER], "answer\udc00": "4"}),
                                         "Line 1: a lone surrogate (\\udc00) in a key of the row"),
    "tool-call arguments lone surrogate": (
        _jsonl({"messages": [USER, {"role": "assistant", "content": None, "tool_calls": [
            {**CALL, "function": {"name": "f", "arguments": json.dumps({"a": "\ud83d"})}}]}]}),
        "Line 1: message 2 tool_calls[0].function.arguments: a lone surrogate (\\ud83d) in a"),
    "invalid UTF-8": (_jsonl(LINES[0]) + b'\n{"messages": "\xff\xfe"}', "Line 2: not valid UTF-8 (byte 0xff"),
    "encoded surrogate": (b'{"messages": "\xed\xa0\x80"}', "Line 1: not valid UTF-8 (byte 0xed"),
    "nested 100,000 deep": (_jsonl(LINES[0]) + b"\n" + b"[" * 100_000 + b"]" * 100_000,
                            "Line 2: nested deeper than 100 levels"),
    "NaN": (b'{"messages": [], "weight": NaN}', "Line 1: not valid JSON (NaN is not a JSON value)"),
    "5,000-digit number": (b'{"messages": [], "n": ' + b"9" * 5000 + b"}", "Line 1: a number with more than"),
    "a row over 2 MiB": (_jsonl(LINES[0], OVER_LONG), f"Line 2: {len(json.dumps(OVER_LONG))} bytes long; a row "
                                                      f"holds at most {MAX_ROW_BYTES} bytes"),
}


@pytest.mark.parametrize("case", sorted(POISONED_UPLOADS))
def test_a_poisoned_upload_is_a_400_naming_the_line(server: LocalServer, watch: Watch, case: str) -> None:
    data, text = POISONED_UPLOADS[case]
    attacker = server.client(ATTACKER)
    with pytest.raises(openai.BadRequestError) as err:
        _upload(attacker, data)
    body = err.value.body
    assert isinstance(body, dict) and (body["code"], body["param"]) == ("invalid_file_format", "file"), body
    assert text in body["message"], body["message"]
    assert not [f for f in attacker.files.list() if f.bytes == len(data)]  # nothing was stored
    reply = server.client(VICTIM).chat.completions.create(model=server.base, messages=[USER], max_tokens=3)
    assert reply.choices[0].message.content is not None


def test_a_large_upload_leaves_health_fast(server: LocalServer, watch: Watch) -> None:
    rows = [{"messages": [{"role": "user", "content": f"question {i} " * 8}, ANSWER]} for i in range(80_000)]
    # and one row near the row bound made of small objects (the slowest JSON to parse per byte)
    rows.append({"messages": [USER], "answer": [{"a": 1}] * (MAX_ROW_BYTES // 10 - 100)})
    rows[-1] = {"messages": [USER, ANSWER], "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "enum": [{"a": 1}] * (MAX_ROW_BYTES // 10 - 100)}}}]}
    data = _jsonl(*rows)
    assert len(data) > 16_000_000
    started = time.perf_counter()
    file_id = _upload(server.client(ATTACKER), data)
    assert server.client(ATTACKER).files.retrieve(file_id).bytes == len(data)
    assert time.perf_counter() - started < 120


def _steps(oa: openai.OpenAI, job_id: str) -> int:
    return sum(1 for e in oa.fine_tuning.jobs.list_events(job_id, limit=100)
               if e.type == "metrics" and "valid_loss" not in (e.data or {}))


def _messages(oa: openai.OpenAI, job_id: str) -> list[str]:
    return [e.message for e in oa.fine_tuning.jobs.list_events(job_id, limit=100)]


def test_poisoned_jobs_fail_alone_while_the_victims_run(server: LocalServer, watch: Watch) -> None:
    attacker, victim = server.client(ATTACKER), server.client(VICTIM)
    lines = upload_jsonl(victim, LINES)
    paused = victim.fine_tuning.jobs.create(model=server.base, training_file=lines,
                                            hyperparameters={"n_epochs": 30, "batch_size": 2})
    cancelled = victim.fine_tuning.jobs.create(model=server.base, training_file=lines,
                                               hyperparameters={"n_epochs": 30, "batch_size": 2})
    for job in (paused, cancelled):
        poll_job(victim, job.id, lambda j: j.status == "running" and (j.trained_tokens or 0) > 0)

    # Rows that take seconds to tokenize (each row to the context's worth of text: 300 rows of 40,000 characters,
    # about 10 s here), then one the tiny llama's template cannot render (tools): it passes upload, and fails
    # when its job is prepared.
    big = {"messages": [{"role": "user", "content": "the quick brown fox " * 2000}, ANSWER]}
    tools = {"messages": [USER, ANSWER], "tools": [{"type": "function", "function": {"name": "f"}}]}
    slow = attacker.fine_tuning.jobs.create(model=server.base,
                                            training_file=_upload(attacker, _jsonl(*[big] * SLOW_ROWS, tools)))
    long_prompt = [{"messages": [{"role": "user", "content": "four " * 4000}], "answer": "4"}] * 10
    too_long = attacker.fine_tuning.jobs.create(
        model=server.base, training_file=_upload(attacker, _jsonl(*long_prompt)),
        method={"type": "reinforcement", "reinforcement": {"grader": GRADER}})
    diverging = attacker.fine_tuning.jobs.create(
        model=server.base, training_file=upload_jsonl(attacker, LINES),
        hyperparameters={"n_epochs": 3, "batch_size": 2, "learning_rate_multiplier": 10},
        extra_body={"lora": {"r": 4, "lora_alpha": 1e30}})

    # While the attacker's slow file is being prepared: the victim's pause and cancel are applied, and a job
    # it starts after the attacker's is prepared and runs, to the end; its model answers a chat.
    victim.fine_tuning.jobs.pause(paused.id)
    victim.fine_tuning.jobs.cancel(cancelled.id)
    poll_job(victim, cancelled.id, lambda j: "Fine-tuning job cancelled" in _messages(victim, j.id), timeout=30)
    time.sleep(1.0)  # a step in flight when the pause arrived may still land
    steps = _steps(victim, paused.id)
    after = victim.fine_tuning.jobs.create(model=server.base, training_file=lines,
                                           hyperparameters={"n_epochs": 1, "batch_size": 4})
    poll_job(victim, after.id, lambda j: j.status != "validating_files", timeout=30)
    assert _steps(victim, paused.id) == steps and victim.fine_tuning.jobs.retrieve(paused.id).status == "paused"
    assert attacker.fine_tuning.jobs.retrieve(slow.id).status == "validating_files"  # all that, meanwhile
    done = poll_job(victim, after.id, timeout=120)
    assert done.status == "succeeded" and done.error is None, done.error
    reply = victim.chat.completions.create(model=done.fine_tuned_model, messages=[USER], max_tokens=4)
    assert reply.choices[0].message.content is not None and reply.usage.completion_tokens >= 1

    failures = {
        too_long.id: ("invalid_training_file", "training_file", "row 1: its prompt"),
        diverging.id: (None, None, "the job's training diverged, which its hyperparameters or data caused"),
        slow.id: ("invalid_training_file", "training_file",
                  f"training example {SLOW_ROWS + 1}: the base model's chat template"),
    }
    for job_id, (code, param, text) in failures.items():
        job = poll_job(attacker, job_id, timeout=300)
        assert job.status == "failed" and job.error is not None, job
        assert job.error.code == code or (code is None and job.error.code.startswith("non_finite_")), job.error
        assert job.error.param == param and text in job.error.message, job.error
        assert f"Job failed: {job.error.message}" in _messages(attacker, job_id)
    victim.fine_tuning.jobs.cancel(paused.id)
