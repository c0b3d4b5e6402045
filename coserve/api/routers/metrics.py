"""`GET /metrics` (Prometheus text, from the scheduler) and `GET /health` (liveness of the serving path).

Neither needs an API key: they are for scrapers, load balancers and probes.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse, PlainTextResponse

from coserve.api.state import GatewayState, get_state

router = APIRouter(tags=["operations"])

PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

State = Annotated[GatewayState, Depends(get_state)]


@router.get("/health")
async def health(state: State) -> JSONResponse:
    """200 `{"status": "ok"}` while requests can be served; 503 with the reason otherwise."""
    problem = None if state.scheduler is None else await state.scheduler.health()
    if problem is not None:
        return JSONResponse({"status": "unavailable", "reason": problem}, status_code=503)
    return JSONResponse({"status": "ok"})


@router.get("/metrics", response_class=PlainTextResponse)
async def metrics(state: State) -> PlainTextResponse:
    """Prometheus text exposition: TTFT/TPOT histograms, tokens by kind and tenant, queues, KV blocks."""
    text = "" if state.scheduler is None else await state.scheduler.metrics_text()
    return PlainTextResponse(text, media_type=PROMETHEUS_CONTENT_TYPE)
