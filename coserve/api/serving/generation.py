"""What the chat and completions services share: model resolution, submission to the scheduler, and
the pieces of their answers (finish reasons, usage, errors).

`model` is a served base model or one of the tenant's fine-tuned models / checkpoints (the store's
models table gives the adapter folder); anything else, another tenant's included, is 404
`model_not_found`. The scheduler checks the context length and the tenant's quota; its refusals come
back as `ProtocolError`s (429 with `retry-after`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from coserve.api.protocol.base import ErrorBody, ErrorResponse, ProtocolError, UsageInfo
from coserve.api.serving.models import model_not_found
from coserve.api.state import GatewayState
from coserve.contract.messages import AdapterSpec, Rejection
from coserve.contract.sampling import SamplingParams
from coserve.frontend.messages import ChatAdmission, ChatSubmission, StreamBatch

if TYPE_CHECKING:
    from coserve.frontend.scheduler_frontend import SchedulerFrontend

DONE_EVENT = "data: [DONE]\n\n"
# The finish reasons a choice's last delta reports (`finish_reason`): both endpoints' wire values.
WireFinishReason = Literal["stop", "length", "grammar_error"]


class Generation:
    """Submits generation requests of one gateway to its scheduler.

    Args:
        state: the gateway's store, served base models and scheduler client.

    Raises:
        ProtocolError: 503 when the gateway has no scheduler.
    """

    def __init__(self, state: GatewayState) -> None:
        if state.scheduler is None:
            raise ProtocolError("This server does not serve completions.", status=503, type="server_error")
        self.state = state
        self.scheduler: SchedulerFrontend = state.scheduler

    def check_n(self, choices: int) -> None:
        """400 naming `n` when a request asks for more completions than the server's `--max-n`."""
        if choices > self.state.max_n:
            raise ProtocolError(f"Invalid 'n': this server generates at most {self.state.max_n} completions "
                                f"per request, got {choices}.", param="n", code="invalid_value")

    @staticmethod
    def sampling(build: Callable[[], SamplingParams]) -> SamplingParams:
        """`build()`, its ValueError (a combination the engine refuses) as a 400."""
        try:
            return build()
        except ValueError as error:
            raise ProtocolError(str(error), code="invalid_value") from None

    async def submit(self, submission: ChatSubmission) -> ChatAdmission:
        """Queue `submission`. Raises its rejection as a `ProtocolError`."""
        admission = await self.scheduler.submit(submission)
        if admission.rejection is not None:
            raise to_error(admission.rejection)
        return admission

    async def abort(self, request_id: str) -> None:
        await self.scheduler.abort(request_id)

    def resolve_model(self, tenant: str, model_id: str) -> AdapterSpec | None:
        """The adapter of a fine-tuned model, None for a served base model; 404 otherwise."""
        record = self.state.store.models.get(tenant, model_id)
        if record is None:
            raise model_not_found(model_id)
        if record.tenant is None:
            if model_id not in self.state.base_models:
                raise model_not_found(model_id)  # registered by an earlier run, not served now
            return None
        if record.base_model not in self.state.base_models or not record.adapter_path:
            raise model_not_found(model_id)
        return AdapterSpec(name=model_id, path=str(self._adapter_dir(record.adapter_path)))

    def _adapter_dir(self, stored: str) -> Path:
        data_dir = self.state.store.data_dir.resolve()
        path = Path(stored)
        path = (path if path.is_absolute() else data_dir / path).resolve()
        if not path.is_relative_to(data_dir) and not Path(stored).is_absolute():
            raise ProtocolError("The model's adapter is outside the data directory.", status=500,
                                type="server_error")
        return path


def to_error(rejection: Rejection) -> ProtocolError:
    """The scheduler's refusal as the client's error (`retry-after` on a 429)."""
    headers = None
    if rejection.retry_after_s is not None:
        headers = {"retry-after": str(max(1, math.ceil(rejection.retry_after_s))),
                   "retry-after-ms": str(max(1, math.ceil(rejection.retry_after_s * 1000)))}
    return ProtocolError(rejection.message, status=rejection.status, type=rejection.type,
                         param=rejection.param, code=rejection.code, headers=headers)


def finish_reason(reason: str | None) -> WireFinishReason:
    """The wire finish reason of a choice's last delta."""
    match reason:
        case "stop" | "length" | "grammar_error":
            return reason
    # Only an aborted request has none of these; nobody reads it (its client is gone).
    return "stop"


def usage(prompt_tokens: int, completion_tokens: int) -> UsageInfo:
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens)


def batch_usage(batch: StreamBatch) -> UsageInfo:
    """The usage a request's last batch reports."""
    return usage(batch.prompt_tokens, batch.completion_tokens)


def error_event(message: str) -> str:
    """The SSE event of a failure after a stream has started (the stream closes after it)."""
    body = ErrorResponse(error=ErrorBody(message=message, type="server_error", code="generation_failed"))
    return f"data: {json.dumps(body.model_dump(mode='json'))}\n\n"
