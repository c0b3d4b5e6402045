"""Scheduling rules that do not depend on the order requests are picked in (shared by the policies)."""

from __future__ import annotations

from dataclasses import dataclass

from coserve.inference.request import Request, RequestStatus

# Prefix-cache salt of base-model requests; adapter ids are >= 0, so no adapter shares it.
BASE_MODEL_SALT = -1


@dataclass(slots=True)
class Budget:
    """What is left of this iteration's token budget."""

    tokens: int


def prefix_salt(request: Request) -> int:
    """Salt for the request's prefix-cache hashes: a LoRA adapter, and each version of an adapter trained
    in place, changes K/V for the same tokens."""
    adapter = request.adapter
    if adapter is None:
        return BASE_MODEL_SALT
    return adapter.adapter_id if adapter.version == 0 else hash((adapter.adapter_id, adapter.version))


def check_new_request(request: Request, max_model_len: int) -> None:
    """Raise ValueError for a request no policy may queue: an empty prompt, a prompt longer than
    `max_model_len`, a negative adapter id, or a status other than WAITING."""
    prompt_len = len(request.prompt_token_ids)
    if prompt_len == 0:
        raise ValueError(f"request {request.request_id!r} has an empty prompt")
    if prompt_len > max_model_len:
        raise ValueError(f"request {request.request_id!r}: prompt has {prompt_len} tokens, more "
                         f"than max_model_len={max_model_len}")
    if request.adapter is not None and request.adapter.adapter_id < 0:
        raise ValueError(f"adapter ids must be >= 0, got {request.adapter.adapter_id}")
    if request.status != RequestStatus.WAITING:
        raise ValueError(f"request {request.request_id!r} is {request.status.name}, not WAITING")


def num_new_tokens(request: Request, token_budget: int, long_prefill_threshold: int = 0) -> int:
    """Tokens the request computes this iteration: what remains, capped by the budget and threshold."""
    return clamp_new_tokens(request.num_tokens - request.num_computed_tokens, token_budget,
                            long_prefill_threshold)


def clamp_new_tokens(remaining: int, token_budget: int, long_prefill_threshold: int = 0) -> int:
    """`num_new_tokens` from the remaining token count (callers that already have it)."""
    count = remaining
    if count > token_budget:
        count = token_budget
    if 0 < long_prefill_threshold < count:
        count = long_prefill_threshold
    return count if count > 0 else 0


def check_stop(request: Request, token_id: int, max_model_len: int) -> RequestStatus | None:
    """The finished status after `token_id` was appended to the request's output, or None.

    EOS and stop token ids are checked before the length limits, so a model that ends exactly at
    `max_tokens` reports `stop` (it did end), not `length`.
    """
    sampling = request.sampling
    if request.num_output_tokens >= sampling.min_tokens:
        if token_id == request.eos_token_id and not sampling.ignore_eos:
            return RequestStatus.FINISHED_STOPPED
        if token_id in (sampling.stop_token_ids or ()):
            return RequestStatus.FINISHED_STOPPED
    if sampling.max_tokens is not None and request.num_output_tokens >= sampling.max_tokens:
        return RequestStatus.FINISHED_LENGTH_CAPPED
    # The next token would sit at position num_tokens, past the model's context.
    if request.num_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH_CAPPED
    return None
