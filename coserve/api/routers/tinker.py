"""HTTP routes of the Tinker API under `/tinker` (the SDK's `base_url` is `http://<server>/tinker`; its
paths are `/api/v1/...`). The key travels in `X-API-Key` (the SDK's header) and maps to a tenant like
an OpenAI key; an unknown route under the prefix is a 404 that names it."""

from __future__ import annotations

import asyncio
import logging
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from coserve.api.auth import identify, require_tenant
from coserve.api.protocol.base import ProtocolError
from coserve.api.protocol.tinker import (
    ClientConfigRequest,
    CreateModelRequest,
    CreateSamplingSessionRequest,
    CreateSessionRequest,
    FinishSessionRequest,
    FutureRetrieveRequest,
    GetInfoRequest,
    LoadWeightsRequest,
    OptimStepRequest,
    SampleRequest,
    SaveWeightsForSamplerRequest,
    SaveWeightsRequest,
    SessionHeartbeatRequest,
    TelemetrySendRequest,
)
from coserve.api.protocol.tinker_wire import PROTOBUF
from coserve.api.serving.tinker_body import decode_call
from coserve.api.serving.tinker_futures import CallFuture, ReadyFuture, SampleFuture
from coserve.api.serving.tinker_sampling import TinkerSampling
from coserve.api.serving.tinker_training import TinkerTraining, checkpoints_body
from coserve.api.state import GatewayState, get_state
from coserve.contract.training_calls import CloseSession, SessionAlive

logger = logging.getLogger(__name__)
router = APIRouter(prefix="/tinker/api/v1", tags=["tinker"])


async def tinker_tenant(request: Request, state: Annotated[GatewayState, Depends(get_state)]) -> str:
    """The tenant of the `X-API-Key` header (or `Authorization: Bearer`), as `require_tenant` checks it;
    the call is taken from its `tinker_requests_per_minute` (a 429 past it). On the event loop: the
    buckets need no lock."""
    key = request.headers.get("x-api-key", "").strip()
    if not key:
        auth = request.headers.get("authorization", "")
        key = auth.partition(" ")[2].strip() if auth.lower().startswith("bearer ") else ""
    if not key:
        raise ProtocolError("No API key: send it in the X-API-Key header.", status=401, code="invalid_api_key")
    tenant = require_tenant(identify(key, state))
    state.tinker_rates.admit(tenant, state.tenants.tenants[tenant].limits)
    return tenant


Tenant = Annotated[str, Depends(tinker_tenant)]
State = Annotated[GatewayState, Depends(get_state)]


def future(request_id: str, model_id: str | None = None) -> dict[str, Any]:
    return {"request_id": request_id, "model_id": model_id}


@router.get("/healthz")
def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/get_server_capabilities")
def capabilities(tenant: Tenant, state: State) -> dict[str, Any]:
    max_len = None if state.scheduler is None else state.scheduler.max_model_len
    return {"supported_models": [{"model_name": m, "max_context_length": max_len, "trainable": True,
                                  "sampleable": True} for m in state.base_models]}


@router.post("/telemetry")
def telemetry(tenant: Tenant, body: TelemetrySendRequest) -> dict[str, str]:
    """The SDK's own reports (its exceptions, timings): written to the server's log, one line per batch."""
    kinds = sorted({str(e.get("event_name") or e.get("event", "?"))[:64] for e in body.events})
    logger.info("tinker SDK %r of tenant %s (session %r): %d telemetry event(s) %s", body.sdk_version, tenant,
                body.session_id, len(body.events), kinds[:8])
    return {"status": "accepted"}


@router.post("/client/config")
def client_config(tenant: Tenant, body: ClientConfigRequest) -> dict[str, Any]:
    """Settings of the SDK's client: plain HTTP/1 JSON and protobuf, no server-side custom losses."""
    return {"pjwt_auth_enabled": False, "credential_default_source": "api_key", "parallel_fwdbwd_chunks": False,
            "proto_compress_fwdbwd": False, "use_pyqwest_transport": False, "sample_use_retrieve_futures": False,
            "custom_loss_server_side": False, "sample_join_sampling_session": False}


@router.post("/create_session")
def create_session(tenant: Tenant, state: State, body: CreateSessionRequest) -> dict[str, Any]:
    return {"type": "create_session", "session_id": state.tinker.open_session(tenant)}


@router.post("/session_heartbeat")
async def heartbeat(tenant: Tenant, state: State, body: SessionHeartbeatRequest) -> dict[str, Any]:
    """The session's runs stay while it sends these (`TrainingRuns`: a silent session's runs end)."""
    await TinkerTraining(state).session(SessionAlive(tenant, body.session_id))
    return {"type": "session_heartbeat"}


@router.post("/sessions/{session_id}/finish")
async def finish_session(tenant: Tenant, state: State, session_id: str, body: FinishSessionRequest) -> dict[str, Any]:
    """`ServiceClient.close()`: the session's runs end and free their adapter slots; saves stay."""
    await TinkerTraining(state).session(CloseSession(tenant, session_id))
    state.tinker.close_session(tenant, session_id)
    return {}


@router.post("/create_model")
async def create_model(tenant: Tenant, state: State, body: CreateModelRequest) -> dict[str, Any]:
    return future(await TinkerTraining(state).create_model(tenant, body))


@router.post("/get_info")
async def get_info(tenant: Tenant, state: State, body: GetInfoRequest) -> dict[str, Any]:
    info = await TinkerTraining(state).info(tenant, body.model_id)
    return {"type": "get_info", "model_id": info.run_id, "is_lora": True, "lora_rank": info.lora.r,
            "model_name": info.base_model, "optimizer_config": {"type": "adamw"},
            "model_data": {"arch": None, "model_name": info.base_model, "tokenizer_id": info.base_model}}


@router.post("/forward_backward")
async def forward_backward(tenant: Tenant, state: State, request: Request) -> dict[str, Any]:
    """The SDK's protobuf body (zstd-compressed when its header says so), decoded and checked off the
    event loop (`tinker_body`)."""
    if PROTOBUF not in request.headers.get("content-type", ""):
        raise ProtocolError(f"forward_backward takes a protobuf body ({PROTOBUF}), as the tinker SDK sends it.",
                            status=415, code="unsupported_media_type")
    training = TinkerTraining(state)
    zstd = request.headers.get("content-encoding", "").strip().lower() == "zstd"
    run_id, call = await decode_call(await request.body(), zstd, state.max_request_bytes, training.bounds())
    return future(await training.forward_backward(tenant, run_id, call), run_id)


@router.post("/optim_step")
async def optim_step(tenant: Tenant, state: State, body: OptimStepRequest) -> dict[str, Any]:
    return future(await TinkerTraining(state).optim_step(tenant, body), body.model_id)


@router.post("/save_weights")
async def save_weights(tenant: Tenant, state: State, body: SaveWeightsRequest) -> dict[str, Any]:
    return future(await TinkerTraining(state).save(tenant, body), body.model_id)


@router.post("/save_weights_for_sampler")
async def save_for_sampler(tenant: Tenant, state: State, body: SaveWeightsForSamplerRequest) -> dict[str, Any]:
    return future(await TinkerTraining(state).save(tenant, body), body.model_id)


@router.post("/load_weights")
async def load_weights(tenant: Tenant, state: State, body: LoadWeightsRequest) -> dict[str, Any]:
    future_id, run_id = await TinkerTraining(state).load(tenant, body)
    return future(future_id, run_id)


@router.get("/training_runs/{model_id}/checkpoints")
async def checkpoints(tenant: Tenant, state: State, model_id: str) -> dict[str, Any]:
    return checkpoints_body(await TinkerTraining(state).info(tenant, model_id))


@router.delete("/training_runs/{model_id}/checkpoints/{checkpoint_id:path}")
async def delete_checkpoint(tenant: Tenant, state: State, model_id: str, checkpoint_id: str) -> Response:
    """`RestClient.delete_checkpoint`: `checkpoint_id` is `weights/<name>` or `sampler_weights/<name>`."""
    await TinkerTraining(state).delete_checkpoint(tenant, model_id, checkpoint_id)
    return Response(status_code=204)


@router.post("/create_sampling_session")
def create_sampling_session(tenant: Tenant, state: State, body: CreateSamplingSessionRequest) -> dict[str, Any]:
    return {"type": "create_sampling_session",
            "sampling_session_id": TinkerSampling(state).open_session(tenant, body)}


@router.get("/samplers/{sampler_id}")
def get_sampler(tenant: Tenant, state: State, sampler_id: str) -> dict[str, Any]:
    session = state.tinker.sampling(tenant, sampler_id)
    if session is None:
        raise ProtocolError(f"No sampler {sampler_id!r}.", status=404, code="sampler_not_found")
    return {"sampler_id": sampler_id, "base_model": session.base_model, "model_path": session.model_path}


@router.post("/asample")
async def asample(tenant: Tenant, state: State, body: SampleRequest) -> dict[str, Any]:
    future_id, sequence_ids = await TinkerSampling(state).sample(tenant, body)
    return {**future(future_id), "sample_sequence_ids": sequence_ids}


@router.post("/retrieve_future", response_model=None)
async def retrieve_future(tenant: Tenant, state: State, body: FutureRetrieveRequest) -> Response:
    """A future's outcome: protobuf for `ForwardBackwardOutput` and `SampleResponse`, JSON otherwise."""
    found = state.tinker.get(tenant, body.request_id)
    if found is None:
        raise ProtocolError(f"No future {body.request_id!r}.", status=404, code="future_not_found")
    if isinstance(found, ReadyFuture):
        state.tinker.forget(body.request_id)
        return JSONResponse(found.body)
    if isinstance(found, CallFuture):
        outcome = await TinkerTraining(state).outcome(tenant, found)
        return Response(outcome, media_type=PROTOBUF) if isinstance(outcome, bytes) else JSONResponse(outcome)
    return await _sample_outcome(state, body.request_id, found)


async def _sample_outcome(state: GatewayState, future_id: str, found: SampleFuture) -> Response:
    try:
        payload = await asyncio.wait_for(asyncio.shield(found.task), timeout=20.0)
    except asyncio.TimeoutError:
        return JSONResponse({"type": "try_again", "request_id": future_id, "queue_state": "active"})
    except Exception as error:  # noqa: BLE001 - the sample failed: its error is the outcome
        state.tinker.forget(future_id)
        return JSONResponse({"error": f"the sample failed: {error}", "category": "server"})
    state.tinker.forget(future_id)
    return Response(payload, media_type=PROTOBUF)


@router.api_route("/{endpoint:path}", methods=["GET", "POST", "PUT", "DELETE"])
def not_implemented(tenant: Tenant, endpoint: str) -> Response:
    raise ProtocolError(f"coserve does not implement the Tinker endpoint '{endpoint}'.", status=404,
                        code="unknown_endpoint")
