"""`/v1/fine_tuning/alpha/graders/run` and `/validate`: OpenAI's bodies and answers
(`openai/types/fine_tuning/alpha/grader_*`). The grader itself is kept as JSON here and parsed once by
`contract.grader.parse_grader` (its errors name the field's path under `grader`)."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from coserve.api.protocol.base import OpenAIBaseModel
from coserve.api.protocol.strict import RequestBody
from coserve.contract.grader import MAX_TEXT_CHARS


class GraderValidateRequest(RequestBody):
    grader: dict[str, Any]


class GraderRunRequest(RequestBody):
    grader: dict[str, Any]
    model_sample: str = Field(max_length=MAX_TEXT_CHARS)
    item: dict[str, Any] = Field(default_factory=dict)


class GraderValidateResponse(OpenAIBaseModel):
    grader: dict[str, Any]


class GraderRunErrors(OpenAIBaseModel):
    """OpenAI's `metadata.errors`: every flag present; the model and python ones stay false here."""

    formula_parse_error: bool = False
    invalid_variable_error: bool = False
    model_grader_parse_error: bool = False
    model_grader_refusal_error: bool = False
    model_grader_server_error: bool = False
    model_grader_server_error_details: str | None = None
    other_error: bool = False
    python_grader_runtime_error: bool = False
    python_grader_runtime_error_details: str | None = None
    python_grader_server_error: bool = False
    python_grader_server_error_type: str | None = None
    sample_parse_error: bool = False
    truncated_observation_error: bool = False
    unresponsive_reward_error: bool = False


class GraderRunMetadata(OpenAIBaseModel):
    errors: GraderRunErrors
    execution_time: float
    name: str
    sampled_model_name: str | None = None
    scores: dict[str, Any]
    token_usage: int | None = None
    type: str


class GraderRunResponse(OpenAIBaseModel):
    metadata: GraderRunMetadata
    model_grader_token_usage_per_model: dict[str, Any] = Field(default_factory=dict)
    reward: float
    sub_rewards: dict[str, Any]
