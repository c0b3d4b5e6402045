"""Request bodies of the Tinker API's JSON endpoints, as the official `tinker` SDK (0.38) sends them.

The field names and defaults are the SDK's (`tinker/types/*_request.py`); an unknown field is a 400
like everywhere in coserve (`RequestModel`). `forward_backward` is protobuf, not JSON
(`tinker_wire`). What coserve cannot honour is refused where it is checked (`api/serving/tinker_*`),
with one documented exception: `lora_config.train_unembed` (the SDK's default is true; coserve's
adapters leave the unembedding frozen, and `get_info` says so).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from coserve.api.protocol.strict import RequestModel


class CreateSessionRequest(RequestModel):
    tags: list[str] = Field(default_factory=list)
    user_metadata: dict[str, Any] | None = None
    sdk_version: str = ""
    project_id: str | None = None
    display_name: str | None = None
    type: Literal["create_session"] = "create_session"


class SessionHeartbeatRequest(RequestModel):
    session_id: str
    type: Literal["session_heartbeat"] = "session_heartbeat"


class FinishReason(RequestModel):
    type: Literal["success", "errored", "interrupted"]


class FinishSessionRequest(RequestModel):
    reason: FinishReason
    detail: str | None = None


MAX_TELEMETRY_EVENTS = 100  # the SDK's batch (`tinker.lib.telemetry.MAX_BATCH_SIZE`); the body: api/app.py


class TelemetrySendRequest(RequestModel):
    events: list[dict[str, Any]] = Field(max_length=MAX_TELEMETRY_EVENTS)
    platform: str = Field(max_length=256)
    sdk_version: str = Field(max_length=256)
    session_id: str = Field(max_length=256)
    process_uuid: str = Field(max_length=256)


class ClientConfigRequest(RequestModel):
    sdk_version: str = ""


class LoraConfig(RequestModel):
    rank: int = Field(ge=1)
    seed: int | None = None
    train_unembed: bool = True
    train_mlp: bool = True
    train_attn: bool = True


class OptimizerConfig(RequestModel):
    type: Literal["adamw"] = "adamw"


class CreateModelRequest(RequestModel):
    session_id: str
    model_seq_id: int = 0
    base_model: str
    user_metadata: dict[str, Any] | None = None
    lora_config: LoraConfig | None = None
    optimizer_config: OptimizerConfig = Field(default_factory=OptimizerConfig)
    type: Literal["create_model"] = "create_model"


class GetInfoRequest(RequestModel):
    model_id: str
    type: Literal["get_info"] = "get_info"


class AdamParams(RequestModel):
    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0


class OptimStepRequest(RequestModel):
    adam_params: AdamParams  # the SDK sends `optim_params` under this name for AdamW
    model_id: str
    seq_id: int | None = None
    type: Literal["optim_step"] = "optim_step"


class FutureRetrieveRequest(RequestModel):
    request_id: str
    allow_metadata_only: bool = False


class SaveWeightsRequest(RequestModel):
    model_id: str
    path: str | None = None
    seq_id: int | None = None
    ttl_seconds: int | None = None
    overwrite: bool = False
    user_metadata: dict[str, str] | None = None
    type: Literal["save_weights"] = "save_weights"


class SaveWeightsForSamplerRequest(RequestModel):
    model_id: str
    path: str | None = None
    sampling_session_seq_id: int | None = None
    kind: Literal["snapshot", "inflight"] = "snapshot"
    seq_id: int | None = None
    ttl_seconds: int | None = None
    user_metadata: dict[str, str] | None = None
    type: Literal["save_weights_for_sampler"] = "save_weights_for_sampler"


class LoadWeightsRequest(RequestModel):
    model_id: str | None = None
    seq_id: int | None = None
    session_id: str | None = None
    model_seq_id: int | None = None
    base_model: str | None = None
    user_metadata: dict[str, Any] | None = None
    path: str
    optimizer: bool
    optimizer_config: OptimizerConfig | None = None
    weights_access_token: str | None = None
    type: Literal["load_weights"] = "load_weights"


class CreateSamplingSessionRequest(RequestModel):
    session_id: str
    sampling_session_seq_id: int = 0
    base_model: str | None = None
    model_path: str | None = None
    type: Literal["create_sampling_session"] = "create_sampling_session"


class EncodedTextChunk(RequestModel):
    tokens: list[int]
    type: Literal["encoded_text"] = "encoded_text"


class ModelInput(RequestModel):
    chunks: list[EncodedTextChunk]


class TinkerSamplingParams(RequestModel):
    """A sample's settings as Tinker's SDK sends them (the engine's: `contract.sampling.SamplingParams`)."""

    max_tokens: int | None = None
    seed: int | None = None
    stop: str | list[str] | list[int] | None = None
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0


class SampleRequest(RequestModel):
    num_samples: int = Field(default=1, ge=1)
    prompt: ModelInput
    sampling_params: TinkerSamplingParams
    base_model: str | None = None
    model_path: str | None = None
    sampling_session_id: str | None = None
    seq_id: int | None = None
    prompt_logprobs: bool | None = None
    topk_prompt_logprobs: int = 0
    topk_sample_logprobs: int = 0
    target_prompt_logprobs: dict[str, Any] | None = None
    prompt_alt_tokens_k: int = 0
    prompt_logprobs_last_n: int | None = None
    record_stability_info: bool | None = None
    type: Literal["sample"] = "sample"
