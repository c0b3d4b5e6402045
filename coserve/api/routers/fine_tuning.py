"""HTTP routes of `/v1/fine_tuning/jobs` (https://platform.openai.com/docs/api-reference/fine-tuning).

`pause` and `resume` are OpenAI's endpoints too (`client.fine_tuning.jobs.pause/resume`). An admin key
may do everything but create: it lists every tenant's jobs (`organization_id` names the tenant) and
reads, cancels, pauses or resumes any of them.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Query

from coserve.api.auth import AnyCaller, Tenant
from coserve.api.protocol.fine_tuning import (
    FineTuningJob,
    FineTuningJobCheckpointList,
    FineTuningJobCreate,
    FineTuningJobEventList,
    FineTuningJobList,
)
from coserve.api.serving.fine_tuning import FineTuningService
from coserve.api.state import GatewayState, get_state

router = APIRouter(prefix="/v1/fine_tuning/jobs", tags=["fine-tuning"])


def get_service(state: Annotated[GatewayState, Depends(get_state)]) -> FineTuningService:
    """FastAPI dependency: the fine-tuning service over the app's store."""
    return FineTuningService(state.store, state.tenants, state.base_models, state.max_lora_rank,
                             dedicated=state.dedicated, python_graders=state.python_graders is not None,
                             live_runs=state.tinker.live_runs)


Service = Annotated[FineTuningService, Depends(get_service)]
Limit = Annotated[int, Query(ge=1, le=100)]
After = Annotated[str | None, Query()]

# Plain `def` handlers: the store blocks (SQLite), so FastAPI runs them in its thread pool.


@router.post("", response_model=FineTuningJob, response_model_exclude_none=False)
def create_job(tenant: Tenant, service: Service, body: FineTuningJobCreate) -> FineTuningJob:
    """Create a job; it starts in `validating_files` and the scheduler takes it from there."""
    return service.create(tenant, body)


@router.get("", response_model=FineTuningJobList)
def list_jobs(caller: AnyCaller, service: Service, after: After = None, limit: Limit = 20) -> FineTuningJobList:
    """A page of the tenant's jobs (an admin: every tenant's), newest first; page on with `after=<last id>`."""
    return service.list_page(caller.tenant, after, limit)


@router.get("/{job_id}", response_model=FineTuningJob)
def retrieve_job(caller: AnyCaller, service: Service, job_id: str) -> FineTuningJob:
    return service.retrieve(service.scope(caller, job_id), job_id)


@router.post("/{job_id}/cancel", response_model=FineTuningJob)
def cancel_job(caller: AnyCaller, service: Service, job_id: str) -> FineTuningJob:
    return service.cancel(service.scope(caller, job_id), job_id)


@router.post("/{job_id}/pause", response_model=FineTuningJob)
def pause_job(caller: AnyCaller, service: Service, job_id: str) -> FineTuningJob:
    return service.pause(service.scope(caller, job_id), job_id)


@router.post("/{job_id}/resume", response_model=FineTuningJob)
def resume_job(caller: AnyCaller, service: Service, job_id: str) -> FineTuningJob:
    return service.resume(service.scope(caller, job_id), job_id)


@router.get("/{job_id}/events", response_model=FineTuningJobEventList)
def list_events(caller: AnyCaller, service: Service, job_id: str, after: After = None,
                limit: Limit = 20) -> FineTuningJobEventList:
    return service.events(service.scope(caller, job_id), job_id, after, limit)


@router.get("/{job_id}/checkpoints", response_model=FineTuningJobCheckpointList)
def list_checkpoints(caller: AnyCaller, service: Service, job_id: str, after: After = None,
                     limit: Limit = 10) -> FineTuningJobCheckpointList:
    return service.checkpoints(service.scope(caller, job_id), job_id, after, limit)
