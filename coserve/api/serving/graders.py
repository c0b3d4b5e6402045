"""The graders endpoints' work: parse and check the grader (a 400 `invalid_grader` naming the field), ask
its model graders' judges (`model_judge`), grade the sample, and shape OpenAI's answer.

The grading runs on the gateway's grading threads (`GatewayState.grading`, a `FairPool`: tenants' calls
least grading time first), a python grader's in a sandbox slot the call waits for on the event loop
(`FairSlots.acquire_async`, fair between tenants, at most `SLOT_WAIT_S`); a call that finds no thread or
slot in time is a 429 with `retry-after`. No thread is held while a call waits."""

from __future__ import annotations

import asyncio

from coserve.api.protocol.base import ProtocolError
from coserve.api.protocol.graders import (
    GraderRunErrors,
    GraderRunMetadata,
    GraderRunRequest,
    GraderRunResponse,
    GraderValidateRequest,
    GraderValidateResponse,
)
from coserve.api.serving.chat import ChatService
from coserve.api.serving.model_judge import check_models, judge_all
from coserve.api.state import GatewayState
from coserve.contract.grader import Grader, PythonGrader, grader_type, parse_grader
from coserve.contract.training_settings import SettingsError
from coserve.graders.checks import check_grader, leaves
from coserve.graders.fair_slots import GradersBusy, Lease
from coserve.graders.grading import Grade, grade
from coserve.graders.judging import model_graders

SLOT_WAIT_S = 15.0  # a call's wait for a python grader slot (a grader runs for at most 10 s)


class GraderService:
    """`graders/run` and `graders/validate` for one gateway (its python graders and its chat judges)."""

    def __init__(self, state: GatewayState) -> None:
        self.python = state.python_graders
        self.pool = state.grading
        self.chat = ChatService(state) if state.scheduler is not None else None

    def checked(self, raw: dict[str, object], tenant: str) -> Grader:
        try:
            grader = parse_grader(raw)
            check_grader(grader, python=self.python is not None, judges=self.chat is not None)
            if self.chat is not None:
                check_models(grader, tenant, self.chat)
        except SettingsError as err:
            raise ProtocolError(err.message, param=err.param, code="invalid_grader") from None
        return grader

    def validate(self, tenant: str, body: GraderValidateRequest) -> GraderValidateResponse:
        self.checked(body.grader, tenant)
        return GraderValidateResponse(grader=body.grader)

    async def run(self, tenant: str, body: GraderRunRequest) -> GraderRunResponse:
        # Parsed and checked in a thread: a grader of thousands of graders (a 1 MB body, refused) took 0.1 s
        # of the event loop on a quiet machine, and /health waited behind it.
        grader = await asyncio.to_thread(self.checked, body.grader, tenant)
        judges = [judge for judge, _ in model_graders(grader)]
        judged = await judge_all(judges, body.item, body.model_sample, tenant, self.chat) \
            if self.chat is not None and judges else {}
        try:  # metrics and python graders' sandboxes: off the event loop
            lease = await self._python_slot(tenant, grader)
            try:
                future = self.pool.submit(tenant, grade, grader, body.item, body.model_sample, self.python,
                                          tenant=tenant, lease=lease, judged=judged)
            except BaseException:
                self._release(lease)
                raise
            future.add_done_callback(lambda _: self._release(lease))  # when its sandbox is gone, not before
            result = await asyncio.wrap_future(future)
        except GradersBusy as err:
            raise ProtocolError(f"{err}; retry shortly", status=429, type="rate_limit_error",
                                code="rate_limit_exceeded", headers={"retry-after": "1"}) from None
        usage: dict[str, int] = {}
        for judge in judges:
            verdict = judged.get(id(judge))
            usage[judge.model] = usage.get(judge.model, 0) + (verdict.tokens if verdict is not None else 0)
        return _response(grader, result, usage)


    async def _python_slot(self, tenant: str, grader: Grader) -> Lease | None:
        """A sandbox slot for the call's python graders (run one after another in it); None: it has none."""
        if self.python is None or not any(isinstance(leaf, PythonGrader) for leaf in leaves(grader)):
            return None
        lease: Lease = await self.python.slots.acquire_async(tenant, SLOT_WAIT_S)
        return lease

    def _release(self, lease: Lease | None) -> None:
        if lease is not None:
            self.python.slots.release(lease)


def _response(grader: Grader, result: Grade, usage: dict[str, int]) -> GraderRunResponse:
    """OpenAI's answer; `usage`: the judges' tokens per model (empty: no model grader)."""
    flags = result.errors
    details = "; ".join(flags.details) or None
    errors = GraderRunErrors(formula_parse_error=flags.formula_parse_error,
                             invalid_variable_error=flags.invalid_variable_error,
                             sample_parse_error=flags.sample_parse_error, other_error=flags.other_error,
                             model_grader_parse_error=flags.model_grader_parse_error,
                             model_grader_server_error=flags.model_grader_server_error,
                             model_grader_server_error_details=details if flags.model_grader_server_error
                             else None,
                             python_grader_runtime_error=flags.python_grader_runtime_error,
                             python_grader_runtime_error_details=details if flags.python_grader_runtime_error
                             else None,
                             python_grader_server_error=flags.python_grader_server_error,
                             python_grader_server_error_type=flags.python_grader_server_error_type)
    scores = {**result.sub_rewards, grader.name: result.reward}
    metadata = GraderRunMetadata(errors=errors, execution_time=result.execution_time, name=grader.name,
                                 scores=scores, type=grader_type(grader),
                                 token_usage=sum(usage.values()) if usage else None,
                                 sampled_model_name=", ".join(sorted(usage)) or None)
    return GraderRunResponse(metadata=metadata, reward=result.reward, sub_rewards=result.sub_rewards,
                             model_grader_token_usage_per_model={m: {"total_tokens": t} for m, t in usage.items()})
