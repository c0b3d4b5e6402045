"""How far a fine-tuning job's batch and its sequences have got: the scheduler-side bookkeeping of
`FinetuneJob` (forward windows done, backward tasklets left per layer). Pure Python."""

from __future__ import annotations

from dataclasses import dataclass, field

from coserve.contract.data_position import DataPosition


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

    def reset(self) -> None:
        """Back to the start (before its forward): a sequence redone after its KV was released."""
        self.started, self.forward_end = False, 0
        self.layer_end = [self.length] * self.num_layers
        self.layer = self.num_layers - 1

    @property
    def backward_done(self) -> bool:
        return self.layer_end[0] == 0


@dataclass(slots=True)
class BatchProgress:
    """One batch: its sequences, run one after the other, and where the data goes on after it."""

    after: DataPosition
    normalizer: int
    sequences: list[SequenceProgress]
    current: int = 0  # index of the sequence in flight (sequences run one after the other)
    evaluation: bool = False  # the validation set: forward windows only, no optimizer step
