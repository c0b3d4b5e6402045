"""A dedicated run that cannot be polled fails its own job, never the job manager's poll (issue 45): two jobs
whose runs are still going when the scheduler restarts are adopted under their names (`DedicatedJobs.start`);
one run's actor raises when polled (a bug in it), the other reports its end. The first job fails with an
`internal_error` naming the exception's type, and its actor is stopped; the second's events are taken in."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from coserve.contract.dedicated_run import RunUpdate
from coserve.contract.job_spec import FinetuneJobSpec, JobEvent, JobEventKind
from coserve.contract.training_plan import TrainingExample
from coserve.finetune.dedicated import DedicatedSettings
from coserve.jobs.dedicated_jobs import DedicatedJobs
from coserve.store import MetadataStore

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def _spec(job_id: str, tenant: str) -> FinetuneJobSpec:
    return FinetuneJobSpec(job_id, tenant, 1, [TrainingExample([1, 2, 3], [False, True, True])] * 4, n_epochs=1,
                           batch_size=4, seed=0, num_layers=2, output_dir="/tmp/none")


def test_a_run_that_raises_when_polled_fails_its_own_job(ray_cluster: None, tmp_path: Path) -> None:
    import ray

    @ray.remote(num_cpus=0)
    class Run:
        """Stands for a DedicatedRun actor: its `poll` raises (a bug), or reports that the job succeeded."""

        def __init__(self, job_id: str, broken: bool) -> None:
            self.job_id, self.broken = job_id, broken

        def poll(self) -> tuple[RunUpdate, int]:
            if self.broken:
                raise RuntimeError("/srv/secret: a bug in the run")
            return RunUpdate(events=[JobEvent(self.job_id, JobEventKind.SUCCEEDED, 1)], done=True), 6

    store = MetadataStore(tmp_path / "data")
    namespace = f"faults-{uuid.uuid4().hex[:8]}"
    runs, ids = [], {}
    for tenant, broken in (("attacker", True), ("victim", False)):
        file = store.files.create(tenant, "t.jsonl", "fine-tune", b"{}")
        job_id = store.jobs.create(tenant, "base", file.id, extensions={"training": {"mode": "dedicated"}}).id
        runs.append(Run.options(name=f"coserve-dedicated-{job_id}", namespace=namespace).remote(job_id, broken))
        ids[tenant] = job_id
    ray.get([run.poll.remote() for run in runs[1:]])  # the actors are up
    jobs = DedicatedJobs(DedicatedSettings(), store, "model", tmp_path / "data", namespace=namespace)
    for tenant, job_id in ids.items():
        assert jobs.start(_spec(job_id, tenant)).handle is not None  # adopted, not launched
    jobs.poll()
    events = {e.job_id: e for e in jobs.pop_events()}
    failed, ended = events[ids["attacker"]], events[ids["victim"]]
    assert failed.kind is JobEventKind.FAILED and failed.code == "internal_error"
    assert "RayTaskError" in failed.message and "/srv/secret" not in failed.message
    assert ended.kind is JobEventKind.SUCCEEDED
    assert jobs.get(ids["attacker"]) is None and jobs.get(ids["victim"]) is None
    with pytest.raises(ValueError):  # the broken run's actor was stopped
        ray.get_actor(f"coserve-dedicated-{ids['attacker']}", namespace=namespace)
