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
from coserve.graders.python_grader import GradersBusy, PythonGraderRunner


def _checked(raw: dict[str, object], python: PythonGraderRunner | None) -> Grader:
    try:
        grader = parse_grader(raw)
        check_grader(grader, python=python is not None)
    except SettingsError as err:
        raise ProtocolError(err.message, param=err.param, code="invalid_grader") from None
    return grader


def validate_grader(body: GraderValidateRequest, python: PythonGraderRunner | None) -> GraderValidateResponse:
    _checked(body.grader, python)
    return GraderValidateResponse(grader=body.grader)


def run_grader(body: GraderRunRequest, python: PythonGraderRunner | None) -> GraderRunResponse:
    grader = _checked(body.grader, python)
    try:
        result = grade(grader, body.item, body.model_sample, python, wait=False)
    except GradersBusy as err:  # each request would otherwise hold a server thread while it waits
        raise ProtocolError(f"{err}; retry shortly", status=429, type="rate_limit_error",
                            code="rate_limit_exceeded", headers={"retry-after": "1"}) from None
    flags = result.errors
    details = "; ".join(flags.details) or None
    errors = GraderRunErrors(formula_parse_error=flags.formula_parse_error,
                             invalid_variable_error=flags.invalid_variable_error,
                             sample_parse_error=flags.sample_parse_error, other_error=flags.other_error,
                             python_grader_runtime_error=flags.python_grader_runtime_error,
                             python_grader_runtime_error_details=details if flags.python_grader_runtime_error
                             else None,
                             python_grader_server_error=flags.python_grader_server_error,
                             python_grader_server_error_type=flags.python_grader_server_error_type)
    scores = {**result.sub_rewards, grader.name: result.reward}
    metadata = GraderRunMetadata(errors=errors, execution_time=result.execution_time, name=grader.name,
                                 scores=scores, type=grader_type(grader))
    return GraderRunResponse(metadata=metadata, reward=result.reward, sub_rewards=result.sub_rewards)
