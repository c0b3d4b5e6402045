"""`/v1/fine_tuning/alpha/graders/run` and `/validate`: OpenAI's bodies and answers
(`openai/types/fine_tuning/alpha/grader_*`). The grader itself is kept as JSON here and parsed once by
`contract.grader.parse_grader` (its errors name the field's path under `grader`); a key that the grader's
type does not have is refused here, as an unknown field anywhere in a request is."""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from coserve.api.protocol.base import OpenAIBaseModel, nested_param
from coserve.api.protocol.strict import RequestBody, refuse_unknown
from coserve.contract.grader import MAX_TEXT_CHARS, unknown_grader_key


def check_grader_keys(grader: dict[str, Any], param: str) -> None:
    """Refuse a key that the grader's type does not have (OpenAI's 400, naming `param` and the key's path
    inside it); in lenient mode it is logged, and `parse_grader` ignores it. Call it inside a validator
    of the request body (responses echo stored graders unchecked)."""
    path = unknown_grader_key(grader)
    refuse_unknown("grader", None if path is None else nested_param(param, path))


class GraderValidateRequest(RequestBody):
    grader: dict[str, Any]

    @model_validator(mode="after")
    def _known_grader_keys(self) -> GraderValidateRequest:
        check_grader_keys(self.grader, "grader")
        return self


class GraderRunRequest(GraderValidateRequest):
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
