"""The gateway's FastAPI application: `build_app(store, tenants, base_models)`.

Served by plain uvicorn in `--local` mode and as the Ray Serve ingress otherwise (`coserve.server.assembly`).
Endpoint routers are listed in `ROUTERS`; a new one plugs in by being appended there: it gets the store,
tenants, limits and scheduler client from `Depends(get_state)` and the caller's tenant from the `Tenant`
dependency. The scheduler client is started and closed by the app's lifespan.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

from fastapi import APIRouter, FastAPI
from starlette.types import ASGIApp, Receive, Scope, Send

from coserve.api.errors import MULTIPART_OVERHEAD_BYTES, BodySizeLimit, install_error_handlers
from coserve.api.protocol import strict
from coserve.api.protocol.models import ModelServing
from coserve.api.protocol.sampling import MAX_N
from coserve.api.routers import chat, completions, files, fine_tuning, graders, metrics, models, responses, tinker
from coserve.api.serving.response_runs import ResponseRuns
from coserve.api.state import DEFAULT_MAX_N, DEFAULT_MAX_REQUEST_BYTES, DEFAULT_MAX_UPLOAD_BYTES, GatewayState
from coserve.store import MetadataStore
from coserve.tenancy.tenants import TenantsConfig

UPLOAD_PATH = "/v1/files"  # the one endpoint whose body is a file (multipart), not JSON
TELEMETRY_PATH = "/tinker/api/v1/telemetry"  # the Tinker SDK's own reports: logged, never needed large
TELEMETRY_MAX_BYTES = 2**20  # 100 events (the SDK's batch) with their tracebacks
ROUTERS: tuple[APIRouter, ...] = (metrics.router, files.router, models.router, chat.router,
                                  completions.router, responses.router, fine_tuning.router, graders.router,
                                  tinker.router)


class LenientParams:
    """ASGI middleware: each request is parsed inside `strict.lenient_params()` (unknown fields are
    dropped with a log line instead of refused)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        with strict.lenient_params():
            await self.app(scope, receive, send)


def _check_limits(max_upload_bytes: int, max_request_bytes: int, max_n: int) -> None:
    """`build_app`'s limits: the byte limits positive integers, `max_n` in 1..MAX_N (ValueError otherwise)."""
    for name, value in (("max_upload_bytes", max_upload_bytes), ("max_request_bytes", max_request_bytes)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if isinstance(max_n, bool) or not isinstance(max_n, int) or not 1 <= max_n <= MAX_N:
        raise ValueError(f"max_n must be an integer in 1..{MAX_N}, got {max_n!r}")


def _lifespan(scheduler: Any) -> Callable[[FastAPI], AbstractAsyncContextManager[None]]:
    """The app's lifespan: `scheduler` (when there is one) started with the app and closed with it."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if scheduler is not None:
            await scheduler.start()
        try:
            yield
        finally:
            if scheduler is not None:
                await scheduler.close()

    return lifespan


def build_app(store: MetadataStore, tenants: TenantsConfig, base_models: Sequence[str], *,
              max_upload_bytes: int = DEFAULT_MAX_UPLOAD_BYTES,
              max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, scheduler: Any = None,
              max_lora_rank: int | None = None, public_metrics: bool = False,
              max_n: int = DEFAULT_MAX_N, dedicated: Any = None, python_graders: Any = None,
              lenient_params: bool = False, serving: ModelServing | None = None) -> FastAPI:
    """The OpenAI-compatible gateway over `store`.

    Args:
        store: the metadata store (files, models, jobs).
        tenants: API keys and tenants (`coserve.tenancy.tenants.load_tenants`).
        base_models: ids of the base models served; registered in the store (idempotent) so that every
            tenant lists them.
        max_upload_bytes: the largest file `POST /v1/files` accepts (413 beyond).
        max_request_bytes: the largest body of every other endpoint (413 `request_too_large` beyond,
            also for chunked bodies without a Content-Length).
        scheduler: the `SchedulerFrontend` behind the generation endpoints and `/metrics`; started and
            closed with the app (its lifespan). None: no chat (503).
        max_lora_rank: the engine's largest adapter rank: a fine-tuning job asking for more is a 400
            (None: not checked here; the engine then fails the job).
        public_metrics: serve `/metrics` to scrapes without an admin key, tenant labels summed away
            (False: an admin key is required).
        max_n: the most completions (`n`) one chat request may ask for, 1..128 (400 above it).
        dedicated: the Ray cluster's room for dedicated fine-tuning runs
            (`coserve.dedicated.capacity.ClusterCapacity`); None: no Ray, a job asking for one is a 400.
        python_graders: the `PythonGraderRunner` of `python` graders; None: they are off (a 400).
        lenient_params: drop unknown request fields with a log line (`--lenient-params`); False: they
            are a 400 `Unrecognized request argument supplied`, as OpenAI answers.
        serving: the engine and dtype serving `base_models` (their `coserve` extension field in
            `/v1/models`); None: not said.

    Raises:
        ValueError: an empty or fine-tuned model id in `base_models`, a byte limit < 1, or `max_n`
            outside 1..128.
    """
    _check_limits(max_upload_bytes, max_request_bytes, max_n)
    for model_id in base_models:
        store.models.ensure_base(model_id)
    store.responses.fail_interrupted()  # background responses of a server that stopped: they ran in it
    app = FastAPI(title="coserve", summary="OpenAI-compatible co-serving of inference and LoRA fine-tuning",
                  lifespan=_lifespan(scheduler))
    app.state.gateway = GatewayState(store=store, tenants=tenants, base_models=tuple(base_models),
                                     max_upload_bytes=max_upload_bytes, max_request_bytes=max_request_bytes,
                                     scheduler=scheduler, max_lora_rank=max_lora_rank,
                                     public_metrics=public_metrics, max_n=max_n, dedicated=dedicated,
                                     python_graders=python_graders, lenient_params=lenient_params,
                                     serving=serving)
    app.state.response_runs = ResponseRuns()  # the Responses API's background responses
    install_error_handlers(app)
    if lenient_params:
        app.add_middleware(LenientParams)
    # Every body is capped before it is parsed: JSON bodies at max_request_bytes (a big one would stall the
    # event loop in parsing), the upload endpoint at its file limit plus the multipart framing.
    app.add_middleware(BodySizeLimit, max_bytes=max_request_bytes,
                       path_limits={UPLOAD_PATH: max_upload_bytes + MULTIPART_OVERHEAD_BYTES,
                                    TELEMETRY_PATH: min(TELEMETRY_MAX_BYTES, max_request_bytes)})
    for router in ROUTERS:
        app.include_router(router)
    return app
