"""HTTP routes of `/v1/fine_tuning/alpha/graders` (`client.fine_tuning.alpha.graders.run/validate`): check
a grader, or grade one sample with it, without a job. Any tenant's key may call them; a model grader's
judge runs as that tenant's inference."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends

from coserve.api.auth import Tenant
from coserve.api.protocol.graders import (
    GraderRunRequest,
    GraderRunResponse,
    GraderValidateRequest,
    GraderValidateResponse,
)
from coserve.api.serving.graders import GraderService
from coserve.api.state import GatewayState, get_state

router = APIRouter(prefix="/v1/fine_tuning/alpha/graders", tags=["fine-tuning"])


def get_service(state: Annotated[GatewayState, Depends(get_state)]) -> GraderService:
    return GraderService(state)


Service = Annotated[GraderService, Depends(get_service)]


@router.post("/validate", response_model=GraderValidateResponse)
def validate(tenant: Tenant, service: Service, body: GraderValidateRequest) -> GraderValidateResponse:
    """The grader as given, once it is known to run here; a 400 naming the field otherwise."""
    return service.validate(tenant, body)


@router.post("/run", response_model=GraderRunResponse)
async def run(tenant: Tenant, service: Service, body: GraderRunRequest) -> GraderRunResponse:
    """Grade `model_sample` for `item`: model graders' judges first, then the rest in a thread."""
    return await service.run(tenant, body)
