"""What every router of the gateway shares, kept on `app.state` and handed out by a dependency.

Routers never import the app: they ask for `GatewayState` with `Depends(get_state)`, so a new router
(chat, fine-tuning) plugs in by being included, and tests can build as many apps as they like.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from coserve.api.protocol.models import ModelServing
from coserve.api.serving.tinker_futures import TinkerFutures
from coserve.api.serving.tinker_rates import TinkerRates
from coserve.graders.fair_pool import FairPool
from coserve.store import MetadataStore
from coserve.tenancy.tenants import TenantsConfig

# The largest upload accepted. OpenAI allows 512 MB, but an upload is validated and stored from memory,
# so the default is lower; operators raise it with `build_app(..., max_upload_bytes=...)`.
DEFAULT_MAX_UPLOAD_BYTES = 128 * 1024 * 1024
# The largest JSON body (chat completions, fine-tuning jobs, ...). The longest prompt a 128k-token model
# takes is about 512 KB of text (~4 characters a token); JSON escapes (`\uXXXX`, 6 bytes for a 2- or
# 3-byte character) at most multiply that by 6: about 3 MB. So 4 MiB refuses no prompt a model can take,
# and bounds what one request makes the gateway parse (json.loads of 4 MiB: tens of ms).
DEFAULT_MAX_REQUEST_BYTES = 4 * 1024 * 1024
# The most completions one chat request may ask for (`n`). OpenAI allows 128; each one is a sequence
# that holds KV blocks and a batch slot, so one request could take the whole engine. `coserve serve
# --max-n` raises it (up to the protocol's 128).
DEFAULT_MAX_N = 16
# `graders/run`'s grading threads, shared fairly between tenants, one at a time per tenant: metrics are
# pure Python under the GIL (a second thread of a tenant's would not grade faster, only slow everyone's
# requests), python graders hold one sandbox slot per tenant anyway.
GRADING_THREADS = 4
GRADINGS_QUEUED = 8  # a tenant's `graders/run` calls waiting for a thread; more: a 429


def _grading_pool() -> FairPool:
    return FairPool(GRADING_THREADS, per_tenant=1, max_queued=GRADINGS_QUEUED, name="coserve-http-grading")


@dataclass(frozen=True, slots=True)
class GatewayState:
    """The gateway's collaborators and limits.

    Args:
        store: the metadata store (files, jobs, models); tenant-scoped reads make isolation the default.
        tenants: API keys and tenants.
        base_models: ids of the base models this server serves (visible to every tenant).
        max_upload_bytes: the largest file accepted by `POST /v1/files`.
        max_request_bytes: the largest body accepted by every other endpoint (JSON bodies).
        scheduler: the `coserve.frontend.scheduler_frontend.SchedulerFrontend` chat and completions go
            to (None: the gateway serves no chat, e.g. in tests of the other endpoints).
        max_lora_rank: the engine's largest adapter rank (None: fine-tuning requests are not checked
            against it).
        public_metrics: `/metrics` without an admin key, tenant labels summed away (False: admin only).
        max_n: the most completions (`n`) one chat request may ask for; more is a 400 naming `n`.
        dedicated: the Ray cluster's room for dedicated fine-tuning runs (`DedicatedCapacity`); None: the
            server has no Ray (`--local`), a job asking for a dedicated run is a 400.
        python_graders: runs `python` graders (`coserve.graders.python_grader.PythonGraderRunner`); None:
            they are off (`--enable-python-graders` not given), a 400.
        lenient_params: unknown request fields are dropped with a log line (`--lenient-params`); False:
            they are a 400 `Unrecognized request argument supplied`, as OpenAI answers.
        serving: the engine and dtype serving the base models (`coserve.api.protocol.models.ModelServing`,
            shown as their `coserve` extension field); None: not said (no engine behind the gateway).
    """

    store: MetadataStore
    tenants: TenantsConfig
    base_models: tuple[str, ...]
    max_upload_bytes: int = DEFAULT_MAX_UPLOAD_BYTES
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    scheduler: Any = None
    max_lora_rank: int | None = None
    public_metrics: bool = False
    max_n: int = DEFAULT_MAX_N
    dedicated: Any = None
    python_graders: Any = None
    lenient_params: bool = False
    serving: ModelServing | None = None
    tinker: TinkerFutures = field(default_factory=TinkerFutures)  # the Tinker API's sessions and futures
    tinker_rates: TinkerRates = field(default_factory=TinkerRates)  # its calls per tenant and minute
    grading: FairPool = field(default_factory=_grading_pool)  # `graders/run`'s threads (graders.fair_pool)


def get_state(request: Request) -> GatewayState:
    """FastAPI dependency: the `GatewayState` of the app serving `request`."""
    state: GatewayState = request.app.state.gateway
    return state
