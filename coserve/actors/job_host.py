"""`JobHost`: what the scheduling policy offers the fine-tuning job manager (`finetuning.JobManager`)."""

from __future__ import annotations

from typing import Protocol

from coserve.policies.adapter_slots import AdapterSlots
from coserve.policies.finetune_job import JobEvent
from coserve.policies.job_roster import TrainingJob
from coserve.policies.kv_blocks import KVBlockManager


class JobHost(Protocol):
    """What the scheduling policy offers for jobs (`CoServingPolicy`, whatever its share)."""

    @property
    def kv(self) -> KVBlockManager: ...

    @property
    def adapters(self) -> AdapterSlots: ...

    def add_job(self, job: TrainingJob) -> None: ...

    def remove_job(self, job_id: str) -> bool: ...

    def pause_job(self, job_id: str) -> bool: ...

    def resume_job(self, job_id: str) -> bool: ...

    def pop_job_events(self) -> list[JobEvent]: ...

    @property
    def finetune_held_back(self) -> str | None:
        """Why the last plan gave the runnable jobs no work (None: it gave them work)."""
