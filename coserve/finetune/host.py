"""`JobHost`: the fine-tuning jobs of one engine, as those who submit and control them see them.

A `JobRunner` (`contract.job_runner`): one class for every engine (`ClusterJobs` starts a job on the
host of the engine it places it on: a server's engines, or the offline `LLM`'s one). Jobs are started,
cancelled, paused and resumed here and their events popped, and the planner that gives them work
(`CoServingPolicy`) reads the same `roster`. A
job's tenant is backlogged in the virtual token counters while it has a runnable job, or while
`also_backlogged` says so (the co-serving policy: queued requests).
"""

from __future__ import annotations

from collections.abc import Callable

from coserve.contract.job_runner import JobNotice
from coserve.contract.job_spec import FinetuneJobSpec, JobEvent
from coserve.finetune.job import CoservedJob
from coserve.finetune.roster import JobRoster, TrainingJob
from coserve.inference.adapter_slots import AdapterSlots
from coserve.inference.kv_blocks import KVBlockManager
from coserve.tenancy.vtc import VirtualTokenCounter


def _never(tenant: str) -> bool:
    del tenant
    return False


class JobHost:
    """Jobs by id with deferred control and events (`roster`), the KV blocks and adapter slots jobs are
    built on, and why the last plan gave the runnable jobs nothing (`finetune_held_back`).

    Args:
        vtc: the counters jobs are chosen and charged by (shared with inference admission when
            co-serving).
        kv: the KV blocks jobs allocate from (build `CoservedJob`s with it).
        adapters: the adapter slots jobs train in.
        default_weight: the VTC weight of a job's tenant that `vtc` does not know yet.
        also_backlogged: whether a tenant has other backlog (queued requests) besides its jobs.
    """

    def __init__(self, vtc: VirtualTokenCounter, kv: KVBlockManager, adapters: AdapterSlots, *,
                 default_weight: float = 1.0, also_backlogged: Callable[[str], bool] = _never) -> None:
        self._vtc = vtc
        self._kv, self._adapters = kv, adapters
        self._default_weight = default_weight
        self._also_backlogged = also_backlogged
        self.roster = JobRoster(vtc, self.sync_backlog)
        self.finetune_held_back: str | None = None
        """Why the last plan gave the runnable jobs no work (None: it gave them work, or none is
        runnable); the scheduler's watchdog reports it on jobs that stopped moving."""

    @property
    def kv(self) -> KVBlockManager:
        return self._kv

    @property
    def adapters(self) -> AdapterSlots:
        return self._adapters

    def sync_backlog(self, tenant: str) -> None:
        """Report the tenant's backlog (a runnable job, or other backlog) to the counters."""
        if self._also_backlogged(tenant) or self.roster.has_runnable(tenant):
            self._vtc.on_backlogged(tenant)
        else:
            self._vtc.on_idle(tenant)

    def start(self, spec: FinetuneJobSpec) -> CoservedJob:
        """Build the job on this engine's KV blocks and adapter slots and schedule its work from the next
        plan on. Raises ValueError on a duplicate id."""
        job = CoservedJob(spec, self._kv, self._adapters)
        self.add(job)
        return job

    def add(self, job: TrainingJob) -> None:
        """Schedule a job built already (on `kv` and `adapters`). Raises ValueError on a duplicate id."""
        self._vtc.ensure_tenant(job.tenant, self._default_weight)
        self.roster.add(job)

    def cancel(self, job_id: str) -> bool:
        """Cancel a job: the next plan stops it in the engine and frees its memory; False if unknown."""
        return self.roster.cancel(job_id)

    def pause(self, job_id: str) -> bool:
        """Pause a job in the next plan (its sequence in flight is redone on resume)."""
        return self.roster.pause(job_id)

    def resume(self, job_id: str) -> bool:
        return self.roster.resume(job_id)

    def get(self, job_id: str) -> TrainingJob | None:
        return self.roster.get(job_id)

    def held_back(self, job_id: str) -> str | None:
        """Why the last plan gave this engine's runnable jobs no work (the same for each of them)."""
        return self.finetune_held_back

    def plan_step(self, job_id: str) -> int:
        return self.roster.last_plan_step

    def pop_events(self) -> list[JobEvent]:
        """Job events (steps, checkpoints, success, failure, cancellation) since the last call."""
        return self.roster.pop_events()

    def pop_notices(self) -> list[JobNotice]:
        return []  # jobs never move between engines here

    @property
    def has_work(self) -> bool:
        """A runnable job, a job waiting for its final save's result, or control for the next plan."""
        return self.roster.has_work

    def has_runnable_job(self) -> bool:
        """A job with work to schedule: the liveness floor owes fine-tuning its share only then (a driven
        run waiting for its client's next call does not keep the share owed)."""
        return any(job.has_work for job in self.roster)
