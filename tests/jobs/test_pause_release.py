"""A paused dedicated run gives its workers back after the pause timeout, in-process (no Ray): the job
manager's side tells a run paused that long to release (`DedicatedJob.release_due`), the run's driver
keeps a release against a later resume and ends it without a terminal event (`DedicatedRun`), and the job
says from which checkpoint it restarts. tests/dedicated/test_dedicated_jobs.py runs it on Ray Train."""

from __future__ import annotations

from typing import Any

from coserve.contract.data_position import DataPosition
from coserve.contract.dedicated_run import Command, RunSpec
from coserve.contract.job_spec import FinetuneJobSpec, JobEvent, JobEventKind
from coserve.contract.training_plan import TrainingExample
from coserve.dedicated.run import DedicatedRun
from coserve.jobs.dedicated_job import DedicatedJob


def _spec(**changes: Any) -> FinetuneJobSpec:
    examples = [TrainingExample([1, 2, 3], [False, True, True])] * 8
    return FinetuneJobSpec("ftjob-1", "acme", 1, examples, n_epochs=2, batch_size=4, seed=0, num_layers=2,
                           output_dir="/tmp/none", **changes)


def _job(**changes: Any) -> DedicatedJob:
    return DedicatedJob(_spec(**changes), "acme", run=None, handle=object(), workers=2, trained_tokens=0)


def test_a_launched_run_is_released_once_it_has_been_paused_for_the_timeout() -> None:
    job = _job()
    assert not job.release_due(now=1000.0, timeout_s=300.0)  # not paused
    job.paused, job.paused_at = True, 100.0
    assert not job.release_due(now=399.9, timeout_s=300.0)
    assert job.release_due(now=400.0, timeout_s=300.0)
    job.releasing = True
    assert not job.release_due(now=500.0, timeout_s=300.0)  # told once
    queued = DedicatedJob(_spec(), "acme", run=None, handle=None, workers=2, trained_tokens=0, paused=True,
                          paused_at=0.0)
    assert not queued.release_due(now=1e6, timeout_s=1.0)  # not launched: it holds no workers


def test_the_job_says_from_where_a_new_run_restarts() -> None:
    assert _job().resume_point() == "the start"
    job = _job(resume_from="/data/adapters/ftjob-1/run-1/ckpt-step-2", start_position=DataPosition(seed=0, step=2))
    assert job.resume_point() == "its checkpoint at step 2"
    assert job.keep(JobEvent("ftjob-1", JobEventKind.CHECKPOINT, 3, path="/x/ckpt-step-3"))
    assert job.resume_point() == "its checkpoint at step 3"


def _run() -> DedicatedRun:
    return DedicatedRun(RunSpec(_spec(), "/models/base", "float32", "/data/adapters/ftjob-1", "run-1", workers=2))


def test_a_release_holds_against_a_resume_and_ends_the_run_without_a_terminal_event() -> None:
    run = _run()
    run.command(int(Command.PAUSE))
    run.command(int(Command.RELEASE))
    run.command(int(Command.RUN))  # resumed while the workers save their checkpoint: the release stands
    checkpoint = JobEvent("ftjob-1", JobEventKind.CHECKPOINT, 3, path="/data/adapters/ftjob-1/run-1/ckpt-step-3")
    assert run.push([checkpoint], trained_tokens=40) == Command.RELEASE
    run._end(None)  # fit returned: the workers ended
    update, trained = run.poll()
    assert update.events == [checkpoint] and update.done and update.released and trained == 40
    later, _ = run.poll()
    assert later.done and later.released and later.events == []


def test_a_cancel_while_releasing_cancels_and_a_release_at_the_end_lets_the_job_succeed() -> None:
    run = _run()
    run.command(int(Command.RELEASE))
    run.command(int(Command.STOP))
    run._end(None)
    update, _ = run.poll()
    assert [e.kind for e in update.events] == [JobEventKind.CANCELLED] and not update.released
    finished = _run()
    finished.command(int(Command.RELEASE))
    finished.push([JobEvent("ftjob-1", JobEventKind.SUCCEEDED, 4, path="/final")])  # it was at the end
    finished._end(None)
    update, _ = finished.poll()
    assert [e.kind for e in update.events] == [JobEventKind.SUCCEEDED] and not update.released
    failed = _run()
    failed.command(int(Command.RELEASE))
    failed._end("RuntimeError: the checkpoint could not be written")
    update, _ = failed.poll()
    assert [e.kind for e in update.events] == [JobEventKind.FAILED] and not update.released
