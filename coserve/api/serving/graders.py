"""The graders endpoints' work: parse and check the grader (a 400 `invalid_grader` naming the field), grade
the sample, and shape OpenAI's answer."""

from __future__ import annotations

from coserve.api.protocol.base import ProtocolError
from coserve.api.protocol.graders import (
    GraderRunErrors,
    GraderRunMetadata,
    GraderRunRequest,
    GraderRunResponse,
    GraderValidateRequest,
    GraderValidateResponse,
)
from coserve.contract.grader import Grader, grader_type, parse_grader
from coserve.contract.training_settings import SettingsError
from coserve.graders.checks import check_grader
from coserve.graders.grading import grade


def _checked(raw: dict[str, object]) -> Grader:
    try:
        grader = parse_grader(raw)
        check_grader(grader)
    except SettingsError as err:
        raise ProtocolError(err.message, param=err.param, code="invalid_grader") from None
    return grader


def validate_grader(body: GraderValidateRequest) -> GraderValidateResponse:
    _checked(body.grader)
    return GraderValidateResponse(grader=body.grader)


def run_grader(body: GraderRunRequest) -> GraderRunResponse:
    grader = _checked(body.grader)
    result = grade(grader, body.item, body.model_sample)
    flags = result.errors
    errors = GraderRunErrors(formula_parse_error=flags.formula_parse_error,
                             invalid_variable_error=flags.invalid_variable_error,
                             sample_parse_error=flags.sample_parse_error, other_error=flags.other_error)
    scores = {**result.sub_rewards, grader.name: result.reward}
    metadata = GraderRunMetadata(errors=errors, execution_time=result.execution_time, name=grader.name,
                                 scores=scores, type=grader_type(grader))
    return GraderRunResponse(metadata=metadata, reward=result.reward, sub_rewards=result.sub_rewards)
