"""Rollouts in flight: the completions a reinforcement job sampled, with the log-prob the sampler gave each
token (`record`, from each iteration's outputs). Pure Python."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from coserve.contract.plan import TokenLogprobs
from coserve.inference.request import Request


class StepOutputs(Protocol):
    """What one iteration sampled (`cluster.engine_core.Step`)."""

    @property
    def advanced(self) -> Sequence[Request]: ...

    def logprobs(self) -> Mapping[str, TokenLogprobs | None]: ...


@dataclass(slots=True)
class Sampling:
    """One completion in flight: its prompt's index, its request and the sampler's log-probs so far."""

    prompt_index: int
    request: Request
    logprobs: list[float] = field(default_factory=list)

    def completion(self) -> list[int]:
        return list(self.request.output_token_ids)[:len(self.logprobs)]


def record(samplings: Sequence[Sampling], outputs: StepOutputs) -> int:
    """Keep the log-prob of each token the iteration sampled for these completions; returns how many."""
    ours = {s.request.request_id: s for s in samplings}
    logprobs, count = outputs.logprobs(), 0
    for request in outputs.advanced:
        sampling = ours.get(request.request_id)
        if sampling is not None:
            lp = logprobs.get(request.request_id)
            if lp is None:
                raise RuntimeError(f"rollout {request.request_id}: the engine returned no log-prob")
            sampling.logprobs.append(lp.logprob)
            count += 1
    return count
