"""Where a fine-tuning job is in its data, and the data order as a rule (pure Python, no torch).

The scheduler decides which examples form the next batch; the engine saves the position inside a
checkpoint. Both use this one definition, so a resumed job takes exactly the batches an
uninterrupted run would have taken.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, replace

_MIX = 0x9E3779B97F4A7C15  # golden-ratio constant: spreads (seed, epoch) over distinct RNG seeds


@dataclass(frozen=True, slots=True)
class DataPosition:
    """Where a job is in its data: the next example is `order(n)[index]` of epoch `epoch`.

    `step` counts optimizer steps done. A batch never spans two epochs: the last batch of an epoch
    may be short (every example is seen exactly once per epoch, and the epoch's reshuffle happens at
    a batch boundary, so resuming needs nothing but this position).
    """

    seed: int
    epoch: int = 0
    index: int = 0
    step: int = 0

    def __post_init__(self) -> None:
        if min(self.epoch, self.index, self.step) < 0:
            raise ValueError(f"negative data position {self}")

    def order(self, num_examples: int) -> list[int]:
        """Epoch `epoch`'s order: a permutation of range(num_examples) drawn from (seed, epoch)."""
        order = list(range(num_examples))
        random.Random((self.seed * _MIX + self.epoch) % 2**63).shuffle(order)
        return order

    def next_batch(self, num_examples: int, batch_size: int) -> tuple[list[int], DataPosition]:
        """The example indices of the next batch and the position after its optimizer step."""
        if num_examples < 1 or batch_size < 1:
            raise ValueError(f"need examples and a batch size >= 1, got {num_examples}, {batch_size}")
        if self.index >= num_examples:
            raise ValueError(f"position {self.index} is past the {num_examples} examples of an epoch")
        end = min(self.index + batch_size, num_examples)
        batch = self.order(num_examples)[self.index: end]
        after = (replace(self, epoch=self.epoch + 1, index=0) if end == num_examples
                 else replace(self, index=end))
        return batch, replace(after, step=self.step + 1)

    def to_dict(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: dict[str, int]) -> DataPosition:
        return cls(seed=int(raw["seed"]), epoch=int(raw["epoch"]), index=int(raw["index"]),
                   step=int(raw["step"]))
