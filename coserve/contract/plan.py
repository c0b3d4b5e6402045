"""The contract between the scheduler (decides) and the engine (executes).

Everything here crosses a process boundary (a Ray call), so it is plain dataclasses of ints, floats,
strings and lists: no tensors. A request's full data is sent once (`NewSequence`), the first time it is
scheduled or again after a preemption; afterwards an iteration only names it in `chunks`.

Token layout of one sequence in one iteration::

    |<------------- block_table covers all of these positions -------------->|
    | computed (K/V already cached) | this chunk: start .. start+num_tokens |
    0                             start                                     end

A chunk is a prefill chunk when it covers prompt positions and a decode when it is the single newest
token. When `end == len(tokens)` the logits of its last position are sampled.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from coserve.contract.sampling import SamplingParams
from coserve.contract.training_plan import TrainingReport, TrainingWork


@dataclass(slots=True)
class NewSequence:
    """A sequence's data, sent the first time it is scheduled (or re-sent after preemption)."""

    request_id: str
    token_ids: list[int]  # prompt, plus the outputs generated before a preemption
    sampling: SamplingParams
    num_output_tokens: int = 0  # outputs already inside token_ids (seeded sampling stays reproducible)
    adapter_slot: int = -1  # -1: the base model


class ScheduledChunk(NamedTuple):
    """Positions [start, start + num_tokens) of one sequence, computed in this iteration.

    An immutable named tuple rather than a dataclass: the planner builds one per running request per
    iteration, and `tuple.__new__(ScheduledChunk, fields)` does that at C speed (a dataclass's
    `__init__` costs twice as much).
    """

    request_id: str
    start: int
    num_tokens: int
    block_table: Sequence[int]  # every block of the sequence: position p is in block_table[p // block_size]
    sample: bool  # sample a token from the last position's logits


@dataclass(slots=True)
class AdapterLoad:
    """Load the PEFT adapter at `path` into bank slot `slot` before the forward runs."""

    slot: int
    adapter_id: int
    path: str


@dataclass(slots=True)
class IterationPlan:
    """One iteration of the engine, decided by a policy."""

    step_id: int
    new_sequences: list[NewSequence] = field(default_factory=list)
    chunks: list[ScheduledChunk] = field(default_factory=list)  # [num_scheduled_seqs], batch order
    freed: list[str] = field(default_factory=list)  # request ids whose engine state is dropped
    adapter_unloads: list[int] = field(default_factory=list)  # slots emptied before loads
    adapter_loads: list[AdapterLoad] = field(default_factory=list)
    training: TrainingWork = field(default_factory=TrainingWork)  # fine-tuning work (training_plan)

    @property
    def num_tokens(self) -> int:
        """Inference tokens of the iteration (fine-tuning tokens: `training.forward_tokens`)."""
        return sum(c.num_tokens for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not (self.chunks or self.freed or self.adapter_loads or self.adapter_unloads
                    or not self.training.is_empty)


@dataclass(slots=True)
class TokenLogprobs:
    """Logprob of a sampled token and the top-N alternatives (sorted, most likely first)."""

    token_id: int
    logprob: float
    rank: int  # 1 = the most likely token
    top_token_ids: list[int]
    top_logprobs: list[float]


@dataclass(slots=True)
class SampledToken:
    """The token sampled for one sequence.

    `grammar_error` is set when the sequence's structured-output grammar could not go on (no token
    allowed, or its matcher failed, e.g. a parser resource limit): `token_id` is then the EOS the engine
    put in its place, and the scheduler ends the request with finish reason `grammar_error`.
    """

    request_id: str
    token_id: int
    logprobs: TokenLogprobs | None = None
    grammar_error: bool = False


@dataclass(slots=True)
class RequestFault:
    """A request of the plan that could not run, and why (`contract.engine.fault_text` of its own error):
    the engine ran the rest of the plan without it (no token is sampled for it), and the scheduler ends
    it alone with this message."""

    request_id: str
    message: str


@dataclass(slots=True)
class StepTimings:
    """Measured wall time of an iteration and its parts, in seconds (feeds the latency model)."""

    total_s: float = 0.0
    prepare_s: float = 0.0
    forward_s: float = 0.0
    sample_s: float = 0.0
    backward_s: float = 0.0  # fine-tuning backward tasklets, optimizer steps and saves


@dataclass(slots=True)
class IterationResult:
    """What the engine did with a plan."""

    step_id: int
    sampled: list[SampledToken] = field(default_factory=list)  # one per chunk with sample=True
    num_tokens: int = 0
    timings: StepTimings = field(default_factory=StepTimings)
    training: TrainingReport = field(default_factory=TrainingReport)
    faults: list[RequestFault] = field(default_factory=list)  # requests that failed alone (no token)
