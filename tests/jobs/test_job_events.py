"""`JobEvents`: what the running jobs report, written into a real metadata store, where one job's event can
never fail another's or raise to the caller (whose step carried other tenants' requests): a NaN step loss
fails that job as its own divergence, non-finite metrics are stored as null (the store's JSON refuses them:
this used to fail every co-batched request), and an event that cannot be recorded fails its job with an
`internal_error`. The runner is scripted: it hands over the events each case needs."""

from __future__ import annotations

import math
import time
from pathlib import Path

from coserve.contract.job_runner import JobNotice
from coserve.contract.job_spec import FinetuneJobSpec, JobEvent, JobEventKind
from coserve.contract.training_plan import TrainingExample
from coserve.jobs.dedicated_job import DedicatedJob
from coserve.jobs.events import JobEvents, Running
from coserve.jobs.storage import JobStorage
from coserve.store import MetadataStore
from coserve.store.records import JobStatus


class ScriptedRunner:
    """A runner that hands over the given events once, knows the given jobs, and notes what it was told."""

    def __init__(self, events: list[JobEvent], jobs: dict[str, DedicatedJob]) -> None:
        self.events, self.jobs, self.cancelled = events, jobs, []

    def pop_events(self) -> list[JobEvent]:
        events, self.events = self.events, []
        return events

    def pop_notices(self) -> list[JobNotice]:
        return [JobNotice(job_id, None, "placed on engine e0, started") for job_id in self.jobs]

    def get(self, job_id: str) -> DedicatedJob | None:
        return self.jobs.get(job_id)

    def cancel(self, job_id: str) -> bool:
        self.cancelled.append(job_id)
        return True


def _running(store: MetadataStore, tenant: str) -> tuple[str, DedicatedJob]:
    file = store.files.create(tenant, "t.jsonl", "fine-tune", b"{}")
    job_id = store.jobs.create(tenant, "base", file.id).id
    store.jobs.update(job_id, status=JobStatus.QUEUED)
    store.jobs.update(job_id, status=JobStatus.RUNNING)
    spec = FinetuneJobSpec(job_id, tenant, 1, [TrainingExample([1, 2, 3], [False, True, True])] * 4, n_epochs=2,
                           batch_size=2, seed=0, num_layers=2, output_dir="/tmp/none")
    return job_id, DedicatedJob(spec, tenant, run=None, handle=None, workers=1, trained_tokens=10)


def test_one_jobs_events_never_fail_another(tmp_path: Path) -> None:
    store = MetadataStore(tmp_path / "data")
    (diverged, job_a), (victim, job_b), (broken, _) = (_running(store, t) for t in ("a", "b", "c"))
    runner = ScriptedRunner([
        JobEvent(diverged, JobEventKind.STEP, 1, loss=math.nan, num_tokens=5),
        JobEvent(victim, JobEventKind.STEP, 1, loss=1.5, num_tokens=5, metrics={"rewards/margins": math.inf}),
        JobEvent(broken, JobEventKind.STEP, 1, loss=1.0),  # its runner has no job object for it: a bug
        JobEvent(victim, JobEventKind.VALIDATION, 1, loss=math.inf),
        JobEvent(victim, JobEventKind.STEP, 2, loss=1.25, num_tokens=5),
    ], {diverged: job_a, victim: job_b})
    running = {job_id: Running(store.jobs.get(t, job_id), runner, None, time.time())
               for job_id, t in ((diverged, "a"), (victim, "b"), (broken, "c"))}
    JobEvents(store, "base", JobStorage(store, {}), running, time.time).record([runner], None, "e0", "dedicated")

    error = store.jobs.get("a", diverged).error
    assert error is not None and error["code"] == "non_finite_loss"
    assert "diverged, which its hyperparameters or data caused, not the server" in error["message"]
    assert diverged in runner.cancelled and diverged not in running  # stopped where it runs
    error = store.jobs.get("c", broken).error
    assert error is not None and error["code"] == "internal_error" and "RuntimeError" in error["message"]
    assert set(running) == {victim} and store.jobs.get("b", victim).status == JobStatus.RUNNING
    events, _ = store.events.page("b", victim, limit=10)
    metrics = sorted((e.data for e in events if e.type == "metrics"), key=lambda d: (d["step"], "valid_loss" in d))
    assert metrics[0] == {"step": 1, "train_loss": 1.5, "total_steps": 4, "rewards/margins": None}
    assert metrics[1]["valid_loss"] is None and metrics[2]["train_loss"] == 1.25
    assert "Placed on engine e0, started" in [e.message for e in events]
