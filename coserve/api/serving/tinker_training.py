"""The Tinker API's training side: runs (`create_model`, `get_info`, checkpoints) and their calls
(`forward_backward`, `optim_step`, saves, loads) sent to the scheduler, and their futures' outcomes.

A call is queued in the scheduler at once and answered with a future; `retrieve_future` waits up to
`WAIT_S` for its outcome, then answers `try_again` (the SDK asks again). Outcomes take the SDK's
shapes: `ForwardBackwardOutput` as protobuf (the SDK reads it only so), the others as JSON; a failed
call is `{"error", "category"}`, which the SDK raises as `RequestFailedError`.
"""

from __future__ import annotations

import uuid
from datetime import datetime, timezone
from typing import Any

from coserve.api.protocol.base import ProtocolError
from coserve.api.protocol.tinker import (
    CreateModelRequest,
    LoadWeightsRequest,
    OptimStepRequest,
    SaveWeightsForSamplerRequest,
    SaveWeightsRequest,
)
from coserve.api.protocol.tinker_wire import forward_backward_output
from coserve.api.serving.generation import Generation
from coserve.api.serving.tinker_data import ModelBounds
from coserve.api.serving.tinker_futures import CallFuture, ReadyFuture, SamplingSession
from coserve.api.state import GatewayState
from coserve.contract.training_calls import (
    AwaitOutcome,
    CallFailure,
    CallPending,
    CallTicket,
    CallTimings,
    CloseSession,
    CreateRun,
    DeleteSave,
    ForwardBackwardCall,
    ForwardBackwardOutcome,
    GetRun,
    LoadCall,
    LoadOutcome,
    OptimStepCall,
    OptimStepOutcome,
    RunAnswer,
    RunInfo,
    RunRequest,
    SaveCall,
    SaveOutcome,
    SessionAlive,
    SubmitCall,
    TrainingCall,
)
from coserve.contract.training_settings import AdamStep, LoRASettings, SettingsError

WAIT_S = 20.0  # one retrieve_future waits this long for an outcome before answering try_again
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


_QUOTAS = ("quota_exceeded", "storage_quota_exceeded")
_TEMPORARY = ("too_many_queued_calls",)


def _refused(failure: CallFailure) -> ProtocolError:
    """A refused call as an error: 404 for what the tenant cannot see, 403 for a quota (the SDK retries a
    429 without end, and a run's quota clears only when the tenant ends a run or deletes), 429 for a run
    whose queue is full (it clears as its calls are done: the SDK retries), 400 for bad input, 503 when
    the server could not do it."""
    code = failure.code
    status = 404 if code.endswith("not_found") else 403 if code in _QUOTAS else 429 if code in _TEMPORARY else 400
    if not failure.user:
        status = 503
    headers = {"retry-after": "1"} if status == 429 else None
    return ProtocolError(failure.message, status=status, code=code, headers=headers)


class TinkerTraining:
    """Runs and their calls for one gateway (module docstring)."""

    def __init__(self, state: GatewayState) -> None:
        if state.scheduler is None:
            raise ProtocolError("This server does not train.", status=503, type="server_error")
        self._state, self._futures = state, state.tinker
        self._scheduler = state.scheduler

    async def _ask(self, query: Any) -> RunAnswer:
        answer: RunAnswer = await self._scheduler.training(query)
        return answer

    async def create_model(self, tenant: str, request: CreateModelRequest) -> str:
        """Start a run; its future is ready at once (`CreateModelResponse`)."""
        if request.base_model not in self._state.base_models:
            raise ProtocolError(f"Base model {request.base_model!r} is not served here; this server serves "
                                f"{list(self._state.base_models)}.", param="base_model", code="model_not_found",
                                status=404)
        config = request.lora_config
        if config is None:
            raise ProtocolError("create_model needs lora_config: coserve trains LoRA adapters.", param="lora_config")
        modules = (ATTENTION if config.train_attn else ()) + (MLP if config.train_mlp else ())
        if not modules:
            raise ProtocolError("train_attn and train_mlp are both false: nothing would train.",
                                param="lora_config")
        try:
            lora = LoRASettings(r=config.rank, target_modules=modules)
        except SettingsError as error:
            raise ProtocolError(str(error), param=f"lora_config.{error.param}") from None
        if self._state.max_lora_rank is not None and config.rank > self._state.max_lora_rank:
            raise ProtocolError(f"LoRA rank {config.rank} is above this server's max_lora_rank "
                                f"{self._state.max_lora_rank}.", param="lora_config.rank")
        self._futures.check_room(tenant)
        metadata = {str(k): str(v) for k, v in (request.user_metadata or {}).items()}
        run_id = self._run_id(tenant, request.session_id, request.model_seq_id)
        info = await self._ask(CreateRun(RunRequest(tenant, run_id, lora, config.seed or 0, metadata)))
        if isinstance(info, CallFailure):
            raise _refused(info)
        assert isinstance(info, RunInfo)
        self._futures.add_run(request.session_id, info.run_id)
        return self._futures.add(tenant, ReadyFuture({"model_id": info.run_id, "type": "create_model"}))

    def _run_id(self, tenant: str, session_id: str, model_seq_id: int) -> str:
        """The id Tinker's SDK derives for a run itself: `<session id>:train:<model seq id>`."""
        if not self._futures.has_session(tenant, session_id):
            raise ProtocolError(f"No session {session_id!r}.", status=404, param="session_id",
                                code="session_not_found")
        return f"{session_id}:train:{model_seq_id}"

    def _open_sampler(self, tenant: str, saved: SaveOutcome) -> str:
        """A sampling session on a sampler's saved weights (registered as `saved.model_id`)."""
        if saved.model_id is None:
            raise ProtocolError("The sampler weights were saved but could not be registered.", status=500,
                                type="server_error")
        adapter = Generation(self._state).resolve_model(tenant, saved.model_id)
        session = SamplingSession(tenant, adapter, self._state.base_models[0], saved.path)
        return self._futures.open_sampling(session)

    async def session(self, query: SessionAlive | CloseSession) -> None:
        if not self._futures.has_session(query.tenant, query.session_id):
            raise ProtocolError(f"No session {query.session_id!r}.", status=404, code="session_not_found")
        await self._ask(query)

    async def delete_checkpoint(self, tenant: str, run_id: str, checkpoint_id: str) -> None:
        """`RestClient.delete_checkpoint`: the save's folder goes (its bytes leave the tenant's storage
        quota) and a sampler's weights stop being a model id."""
        refused = await self._ask(DeleteSave(tenant, run_id, checkpoint_id))
        if isinstance(refused, CallFailure):
            raise _refused(refused)

    async def info(self, tenant: str, run_id: str) -> RunInfo:
        info = await self._ask(GetRun(tenant, run_id))
        if isinstance(info, CallFailure):
            raise _refused(info)
        assert isinstance(info, RunInfo)
        return info

    async def submit(self, tenant: str, run_id: str, call: TrainingCall, opens_sampler: bool = False) -> str:
        """Queue a call after the run's earlier ones (the SDK sends them in `seq_id` order); its future's id."""
        self._futures.check_room(tenant)
        ticket = await self._ask(SubmitCall(tenant, run_id, call))
        if isinstance(ticket, CallFailure):
            raise _refused(ticket)
        assert isinstance(ticket, CallTicket)
        return self._futures.add(tenant, CallFuture(ticket.call_id, opens_sampler), ticket.call_id)

    def bounds(self) -> ModelBounds:
        """What a datum is checked against (`tinker_data`): the context length and the vocabulary."""
        return ModelBounds(self._scheduler.max_model_len, self._scheduler.vocab_size)

    async def forward_backward(self, tenant: str, run_id: str, call: ForwardBackwardCall) -> str:
        return await self.submit(tenant, run_id, call)

    async def optim_step(self, tenant: str, request: OptimStepRequest) -> str:
        p = request.adam_params
        try:
            adam = AdamStep(p.learning_rate, p.beta1, p.beta2, p.eps, p.weight_decay, p.grad_clip_norm)
        except SettingsError as error:
            raise ProtocolError(str(error), param=f"adam_params.{error.param}") from None
        return await self.submit(tenant, request.model_id, OptimStepCall(adam))

    async def save(self, tenant: str, request: SaveWeightsRequest | SaveWeightsForSamplerRequest) -> str:
        """A training state or a sampler's weights. A sampler save without a name is the SDK's
        `save_weights_and_get_sampling_client`: its outcome also opens a sampling session on the weights.
        Both kinds are snapshots: an `inflight` client's contract (the weights of its creation, or newer)
        holds for a snapshot taken at its creation."""
        resumable = isinstance(request, SaveWeightsRequest)
        name = request.path or f"sampler-{uuid.uuid4().hex[:12]}"
        return await self.submit(tenant, request.model_id, SaveCall(name, resumable),
                                 opens_sampler=not resumable and request.path is None)

    async def load(self, tenant: str, request: LoadWeightsRequest) -> tuple[str, str]:
        """Load saved weights into a run; without `model_id`, into a new run with the saved run's LoRA
        settings (the SDK's `create_training_client_from_state`). Returns the future's and the run's ids."""
        run_id = request.model_id
        if run_id is None:
            if request.base_model is not None and request.base_model not in self._state.base_models:
                raise ProtocolError(f"Base model {request.base_model!r} is not served here.", status=404,
                                    param="base_model", code="model_not_found")
            if request.session_id is None or request.model_seq_id is None:
                raise ProtocolError("load_weights without a model_id needs session_id and model_seq_id.",
                                    param="session_id")
            run_id = self._run_id(tenant, request.session_id, request.model_seq_id)
            info = await self._ask(CreateRun(RunRequest(tenant, run_id, LoRASettings()), like_path=request.path))
            if isinstance(info, CallFailure):
                raise _refused(info)
            assert isinstance(info, RunInfo)
            self._futures.add_run(request.session_id, info.run_id)
            run_id = info.run_id
        call = LoadCall(request.path, request.optimizer)
        return await self.submit(tenant, run_id, call), run_id

    async def outcome(self, tenant: str, future: CallFuture) -> bytes | dict[str, Any]:
        """A call's outcome in the SDK's shape, `try_again` while it is not done."""
        call_id = future.call_id
        outcome = await self._ask(AwaitOutcome(tenant, call_id, WAIT_S))
        if isinstance(outcome, CallPending):
            if outcome.reason is None:
                return {"type": "try_again", "request_id": call_id, "queue_state": "active"}
            return {"type": "try_again", "request_id": call_id, "queue_state": "paused_capacity",
                    "queue_state_reason": outcome.reason}
        self._futures.forget(call_id)
        if isinstance(outcome, CallFailure):
            if outcome.code == "call_not_found":
                raise _refused(outcome)
            return {"error": outcome.message, "category": "user" if outcome.user else "server"}
        if isinstance(outcome, ForwardBackwardOutcome):
            return forward_backward_output([o.logprobs for o in outcome.outputs],
                                           {"loss:sum": outcome.loss_sum, **timing_metrics(outcome.timings)})
        if isinstance(outcome, OptimStepOutcome):
            return {"metrics": {"grad_norm:mean": outcome.grad_norm, "learning_rate:mean": outcome.learning_rate,
                                "step:max": float(outcome.step), **timing_metrics(outcome.timings)}}
        if isinstance(outcome, SaveOutcome) and future.opens_sampler:
            return {"path": outcome.path, "type": "save_weights_for_sampler",
                    "sampling_session_id": self._open_sampler(tenant, outcome)}
        if isinstance(outcome, SaveOutcome):
            kind = "save_weights_for_sampler" if outcome.model_id is not None else "save_weights"
            return {"path": outcome.path, "type": kind}
        assert isinstance(outcome, LoadOutcome)
        return {"path": outcome.path, "model_id": outcome.run_id, "type": "load_weights"}


def timing_metrics(timings: CallTimings) -> dict[str, float]:
    """Where a call's time went in the scheduler, as metrics (Tinker's names end in how chunks combine)."""
    return {"coserve/queued_s:max": timings.queued_s, "coserve/compute_s:max": timings.compute_s,
            "coserve/iterations:max": float(timings.iterations)}


def checkpoints_body(info: RunInfo) -> dict[str, Any]:
    """`CheckpointsListResponse` of a run."""
    return {"checkpoints": [{
        "checkpoint_id": f"{'weights' if c.resumable else 'sampler_weights'}/{c.name}",
        "checkpoint_type": "training" if c.resumable else "sampler",
        "time": datetime.fromtimestamp(c.created, timezone.utc).isoformat(), "tinker_path": c.path,
        "size_bytes": c.size_bytes, "public": False} for c in info.checkpoints], "cursor": None}
