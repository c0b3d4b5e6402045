"""HTTP routes of `/v1/fine_tuning/alpha/graders` (`client.fine_tuning.alpha.graders.run/validate`): check
a grader, or grade one sample with it, without a job. Any tenant's key may call them."""

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
from coserve.api.serving.graders import run_grader, validate_grader
from coserve.api.state import GatewayState, get_state

router = APIRouter(prefix="/v1/fine_tuning/alpha/graders", tags=["fine-tuning"])


State = Annotated[GatewayState, Depends(get_state)]


@router.post("/validate", response_model=GraderValidateResponse)
def validate(tenant: Tenant, state: State, body: GraderValidateRequest) -> GraderValidateResponse:
    """The grader as given, once it is known to run here; a 400 naming the field otherwise."""
    del tenant  # any tenant may validate
    return validate_grader(body, state.python_graders)


@router.post("/run", response_model=GraderRunResponse)
def run(tenant: Tenant, state: State, body: GraderRunRequest) -> GraderRunResponse:
    """Grade `model_sample` for `item` (plain `def`: the metrics and python graders' child processes run
    in FastAPI's thread pool)."""
    del tenant
    return run_grader(body, state.python_graders)
