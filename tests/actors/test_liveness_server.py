"""Liveness through the real server: a job on a fresh server, with default or hard settings, finishes."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import pytest

from coserve.jobs.watchdog import JobWatchdog
from local_server import local_server, poll_job, upload_jsonl

KEY = "sk-live"
TENANTS = {"alpha": {"api_keys": [KEY]}}
ROWS = [{"messages": [{"role": "user", "content": f"Say the number {i}."},
                      {"role": "assistant", "content": f"The number is {i}."}]} for i in range(16)]


def _train(oa, model: str) -> str:  # noqa: ANN001 - the official client
    return oa.fine_tuning.jobs.create(model=model, training_file=upload_jsonl(oa, ROWS),
                                      hyperparameters={"n_epochs": 2}).id


def test_a_job_that_is_the_first_thing_a_fresh_server_does_succeeds_on_defaults(
        model_dirs: dict[str, Path], tmp_path: Path) -> None:
    """The regression of the first real-world report: on a fresh server with `coserve serve`'s defaults
    (64 sequences, 2048 batch tokens, 100 ms TPOT SLO, a latency model learned online), a job created
    before any chat request sat with one engine iteration for minutes."""
    with local_server(model_dirs["mistral"], tmp_path, TENANTS, max_num_seqs=64, max_batch_tokens=2048) as srv:
        oa = srv.client(KEY)
        job = poll_job(oa, _train(oa, srv.base), timeout=90)
        assert job.status == "succeeded" and job.trained_tokens > 0


def test_a_job_finishes_beside_chat_under_a_tiny_budget_and_an_impossible_slo(
        model_dirs: dict[str, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """64 batch tokens and a 1 ms TPOT SLO that no iteration can meet, while two clients keep chatting:
    only fine-tuning's minimum share trains, and the job still succeeds. The server says plainly, once it has
    measured its decodes, that its decode iterations already exceed the SLO and which flag to change."""
    caplog.set_level(logging.WARNING, logger="coserve")
    with local_server(model_dirs["qwen2"], tmp_path, TENANTS, max_num_seqs=8, max_batch_tokens=64,
                      tpot_slo_ms=1.0) as srv:
        oa = srv.client(KEY)
        stop = threading.Event()

        def chat() -> None:
            while not stop.is_set():
                oa.chat.completions.create(model=srv.base, messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=16)

        clients = [threading.Thread(target=chat) for _ in range(2)]
        for thread in clients:
            thread.start()
        try:
            job = poll_job(oa, _train(oa, srv.base), timeout=240, interval=0.5)
        finally:
            stop.set()
            for thread in clients:
                thread.join(60)
        assert job.status == "succeeded"
    warnings = [r.getMessage() for r in caplog.records if "raise --tpot-slo-ms" in r.getMessage()]
    # One decode, or the full batch of 8 when the model learned online prices one decode under 1 ms.
    assert warnings and warnings[0].startswith("coserve: tpot_slo_ms=1 ") and \
        "is below the predicted" in warnings[0] and " decode(s) on this machine" in warnings[0], warnings


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_watchdog_says_once_why_a_job_stopped_and_when_it_moves_again() -> None:
    clock = _Clock()
    dog = JobWatchdog(stall_after_s=30.0, clock=clock)
    assert dog.check({"a": 5, "b": 7}, None) == []
    clock.now = 29.0
    assert dog.check({"a": 5, "b": 8}, "held back: x") == []
    clock.now = 31.0
    [notice] = dog.check({"a": 5, "b": 8}, "held back: predicted iteration 140 ms > the 90 ms the TPOT SLO leaves")
    assert notice.job_id == "a" and notice.stalled
    assert notice.message == ("No progress for 31 s: held back: predicted iteration 140 ms > the 90 ms the "
                              "TPOT SLO leaves")
    assert dog.stalled == 1
    clock.now = 200.0
    assert [n.job_id for n in dog.check({"a": 5, "b": 8}, None)] == ["b"]  # said once per stall
    assert dog.stalled == 2
    [moved] = dog.check({"a": 6}, None)  # b finished: forgotten
    assert (moved.job_id, moved.stalled, moved.message) == ("a", False, "Training resumed")
    assert dog.stalled == 0
    with pytest.raises(ValueError):
        JobWatchdog(stall_after_s=0)


def test_the_watchdog_tells_a_slow_engine_from_a_job_left_out_of_its_plans() -> None:
    clock = _Clock()
    dog = JobWatchdog(stall_after_s=60.0, clock=clock)
    assert dog.check({"slow": 3, "left-out": 4}, None, plan_steps={"slow": 10, "left-out": 10}) == []
    clock.now = 61.0
    slow, left_out = dog.check({"slow": 3, "left-out": 4}, None, plan_steps={"slow": 12, "left-out": 12})
    assert slow.message == ("No progress for 61 s: the engine built 2 plans in 61 s (a machine too slow for "
                            "the batch: the job's pieces wait for its iterations)")
    assert left_out.message == slow.message  # both saw the same two plans
    dog = JobWatchdog(stall_after_s=60.0, clock=clock)
    assert dog.check({"left-out": 4}, None, plan_steps={"left-out": 12}) == []
    clock.now = 130.0
    [notice] = dog.check({"left-out": 4}, None, plan_steps={"left-out": 400})
    assert notice.message == "No progress for 69 s: its next piece found no free KV block or adapter slot"
