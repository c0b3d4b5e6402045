"""How far a fine-tuning job's batch and its sequences have got: the scheduler-side bookkeeping of
`CoservedJob` (forward windows done, backward tasklets left per layer). Pure Python."""

from __future__ import annotations

from dataclasses import dataclass, field

from coserve.contract.data_position import DataPosition
from coserve.contract.loss_spec import LossSpec, TokenInputs
from coserve.contract.training_plan import BackwardTasklet, PairStart, TrainingExample


@dataclass(slots=True)
class SequenceProgress:
    """One training sequence: its forward end, and per layer the tokens whose backward is still to do."""

    sequence_id: str
    example_index: int
    length: int
    num_layers: int
    started: bool = False
    forward_end: int = 0
    layer_end: list[int] = field(default_factory=list)  # per layer: tokens [0, end) still to do
    layer: int = 0  # the layer whose tasklets come next (layer-major: the highest unfinished)
    # DPO: a pair's rejected answer, a reference pass (forward only, base model), and the group of
    # sequences whose forwards all run before any of their backwards (a pair's two trained sequences;
    # a supervised sequence is a group of its own: each sequence of a batch has its own number).
    rejected: bool = False
    reference: bool = False
    group: int = 0
    pair: PairStart | None = None
    # A reinforcement job's graded rollout: its tokens and its loss's per-token inputs (None: the job's
    # example `example_index`).
    example: TrainingExample | None = None
    inputs: TokenInputs | None = None
    # A driven run's datum: its own loss, and its windows report every token's log-prob.
    loss: LossSpec | None = None
    report_logprobs: bool = False
    marks_gradient: bool = False  # a driven call's first: the engine keeps the gradient before it

    def reset(self) -> None:
        """Back to the start (before its forward): a sequence redone after its KV was released."""
        self.started, self.forward_end = False, 0
        self.layer_end = [self.length] * self.num_layers
        self.layer = self.num_layers - 1

    @property
    def backward_done(self) -> bool:
        return self.layer_end[0] == 0

    def take_backward(self, budget: int, min_tasklet_tokens: int) -> list[BackwardTasklet]:
        """Cut the next backward tasklets, layer-major (last layer first, last tokens first), within
        `budget` token-layers; none shorter than `min_tasklet_tokens` unless it ends its layer."""
        tasklets = []
        while not self.backward_done:
            layer = self.layer
            end = self.layer_end[layer]
            count = min(budget, end)
            if count < 1 or (count < end and count < min_tasklet_tokens):
                break
            tasklets.append(BackwardTasklet(self.sequence_id, layer, layer + 1, end - count, end))
            self.layer_end[layer] -= count
            if self.layer_end[layer] == 0 and layer > 0:
                self.layer -= 1
            budget -= count
        return tasklets

    @property
    def token_layers_done(self) -> int:
        """Work done on it since its start, in token-layers: a forward token passes every layer."""
        return self.forward_end * self.num_layers + sum(self.length - end for end in self.layer_end)


@dataclass(slots=True)
class BatchProgress:
    """One batch: its sequences, run one after the other, and where the data goes on after it."""

    after: DataPosition
    normalizer: int
    sequences: list[SequenceProgress]
    current: int = 0  # index of the sequence in flight (sequences run one after the other)
    evaluation: bool = False  # the validation set: forward windows only, no optimizer step
    pairs: list[int] = field(default_factory=list)  # a DPO batch's pair (example) indices
    metrics: dict[str, float] = field(default_factory=dict)  # joined to its step's event (a fed batch's rewards)

    def forward_only(self, seq: SequenceProgress) -> bool:
        return self.evaluation or seq.reference

    def group_of(self, seq: SequenceProgress) -> list[SequenceProgress]:
        return [s for s in self.sequences if s.group == seq.group and not self.forward_only(s)]

    def in_flight(self) -> list[SequenceProgress]:
        """The sequence in flight and, for a DPO pair, the rest of its group ([] once the batch is done)."""
        if self.current >= len(self.sequences):
            return []
        seq = self.sequences[self.current]
        return [seq] if self.forward_only(seq) else self.group_of(seq)

