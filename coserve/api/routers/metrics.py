"""`GET /metrics` (Prometheus text, from the scheduler) and `GET /health` (liveness of the serving path).

`/health` needs no key: it is for load balancers and probes. `/metrics` names tenants, so it needs an
admin key (`admin_api_keys` in the tenants file; `Authorization: Bearer <key>` in the scrape config).
With `public_metrics` (`coserve serve --public-metrics`) anyone may scrape it, but only an admin
scrape sees the `tenant` label: the others get every series summed over tenants.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, PlainTextResponse

from coserve.api.auth import bearer_key, identify, require_admin
from coserve.api.metrics_view import without_label
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


def _sees_tenants(request: Request, state: GatewayState) -> bool:
    """Whether this scrape may see tenant labels (an admin's); raises 401/403 when it may see nothing."""
    if not state.public_metrics:
        require_admin(identify(bearer_key(request), state))
        return True
    if "authorization" not in request.headers:
        return False
    return identify(bearer_key(request), state).is_admin


@router.get("/metrics", response_class=PlainTextResponse)
async def metrics(request: Request, state: State) -> PlainTextResponse:
    """Prometheus text exposition: TTFT/TPOT histograms, tokens by kind and tenant, queues, KV blocks."""
    sees_tenants = _sees_tenants(request, state)
    text = "" if state.scheduler is None else await state.scheduler.metrics_text()
    if not sees_tenants:
        text = without_label(text, "tenant")
    return PlainTextResponse(text, media_type=PROMETHEUS_CONTENT_TYPE)
