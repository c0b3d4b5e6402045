"""Requests as the scheduler sees them: the status machine, token lists, and the `n` requests of one
prompt (`expand_request`).

Only the scheduler changes a request's status. The order of `RequestStatus` is meaningful: every status
after `PREEMPTED` is a finished one, so `is_finished` is a single comparison (as in vLLM v1).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field, replace

from coserve.contract.sampling import AdapterRef, EosIds, SamplingParams


class RequestStatus(enum.IntEnum):
    """Life cycle of an inference request. Everything after PREEMPTED is finished."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH_CAPPED = 4
    FINISHED_ABORTED = 5
    FINISHED_GRAMMAR_ERROR = 6  # the structured-output grammar allowed no token (engine-side failure)

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.PREEMPTED


# The one table from finished states to OpenAI finish reasons.
FINISH_REASONS: dict[RequestStatus, str] = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_GRAMMAR_ERROR: "grammar_error",
}


@dataclass(slots=True)
class Request:
    """One sequence to generate, owned by the scheduler.

    `num_computed_tokens` counts the positions whose K/V are in the cache; it catches up with
    `num_tokens` (prompt + output). That single rule covers chunked prefill, decode, prefix-cache hits
    and recompute after preemption.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    eos_token_id: int | None = None
    adapter: AdapterRef | None = None
    tenant: str = "default"
    arrival_time: float = 0.0
    # The request this one is a sequence of when it asked for n > 1 (its siblings share it); None: a
    # request of its own. The TTFT guard acts for one sequence of a fan-out, not all (`fanouts.py`).
    parent_id: str | None = None
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    # Prompt tokens the prefix cache held at its first admission (usage's `cached_tokens`); None before it.
    num_cached_tokens: int | None = None
    retain_kv_s: float = 0.0  # keep its KV this long once it ends normally (`kv_retention`)
    _output_token_ids: list[int] = field(default_factory=list)
    # Prompt + output length, kept as a field: the planner reads it for every running request in
    # every iteration, and a property costs 10x an attribute there.
    num_tokens: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        self.num_tokens = len(self.prompt_token_ids) + len(self._output_token_ids)

    @property
    def output_token_ids(self) -> tuple[int, ...]:
        return tuple(self._output_token_ids)

    def output_tokens_since(self, start: int) -> list[int]:
        """The output tokens from position `start` on (a stream's new tokens, without copying the rest)."""
        return self._output_token_ids[start:]

    @property
    def num_output_tokens(self) -> int:
        return len(self._output_token_ids)

    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self._output_token_ids

    def append_output_token(self, token_id: int) -> None:
        """The only way to grow the output; keeps `all_token_ids` consistent."""
        self._output_token_ids.append(token_id)
        self.num_tokens += 1

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASONS.get(self.status)


def expand_request(request_id: str, prompt_token_ids: list[int], params: SamplingParams, eos: EosIds,
                   adapter: AdapterRef | None = None, tenant: str = "default",
                   arrival_time: float | None = None, retain_kv_s: float = 0.0) -> list[Request]:
    """The `params.n` scheduler requests of one prompt, ids `{request_id}-{i}`.

    Child i samples with `seed + i` (a seeded request with n > 1 gives n different, reproducible
    completions) and stops on the model's extra EOS ids unless `ignore_eos`. With n > 1 the children
    name `request_id` as their `parent_id` (a fan-out, `coserve.inference.fanouts`).
    """
    arrival = time.monotonic() if arrival_time is None else arrival_time
    children = []
    for index in range(params.n):
        child = replace(params, n=1, seed=None if params.seed is None else params.seed + index)
        if eos.extra and not child.ignore_eos:
            child.stop_token_ids = list(child.stop_token_ids or ()) + list(eos.extra)
        children.append(Request(request_id=f"{request_id}-{index}", prompt_token_ids=list(prompt_token_ids),
                                sampling=child, eos_token_id=eos.eos, adapter=adapter, tenant=tenant,
                                arrival_time=arrival, parent_id=request_id if params.n > 1 else None,
                                retain_kv_s=retain_kv_s))
    return children
