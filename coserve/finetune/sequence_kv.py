"""The KV blocks of a fine-tuning job's sequences: taken window by window, freed after their step, given
back when inference needs them, and kept once inference has taken them too often.

Training borrows memory, inference owns it: when a request needs blocks and none are free, the inference
scheduler asks fine-tuning for the blocks of its sequence in flight (`CoservedJob.release_kv`), and the
sequence is redone from its first token. Under a steady stream of long prompts on a small cache that can
happen to the same sequence every time it gets going, and the job would never finish a sequence. So a
sequence (a DPO pair: its group) dropped `MAX_DROPS` times in a row is **kept**:

- its blocks are no longer given back (`release` refuses);
- its next forward window takes the blocks of the whole sequence at once, so it never needs another;
- until it has them, `reserve` is the number of blocks it still needs, which the inference scheduler's
  admissions leave free (running requests still grow, and preempt each other when they must).

The hold ends with the sequence: the next one borrows again. `kept` counts the sequences held so (the
watchdog writes an event when it grows). Pure Python.
"""

from __future__ import annotations

from collections.abc import Sequence

from coserve.contract.plan import IterationPlan
from coserve.finetune.progress import SequenceProgress
from coserve.inference.kv_blocks import KVBlockManager

MAX_DROPS = 2
"""Times in a row inference may take a sequence's blocks back; after that the sequence keeps them."""


class SequenceKV:
    """The blocks of one job's sequences (module docstring).

    Args:
        kv: the block manager of the engine the job trains on.
    """

    def __init__(self, kv: KVBlockManager) -> None:
        self._kv = kv
        self._to_free: list[str] = []  # sequences done in the planned step: freed once it ran
        self._dropped: str | None = None  # the sequence (its group's first) whose blocks were taken last
        self._drops = 0  # how many times in a row
        self.kept = 0  # sequences dropped MAX_DROPS times in a row, which then kept their blocks
        self.kept_tokens = 0  # the tokens of the last one (a DPO pair: both sequences)

    @property
    def block_size(self) -> int:
        return self._kv.block_size

    @property
    def num_blocks(self) -> int:
        return self._kv.num_blocks

    @property
    def holding(self) -> bool:
        """Whether a sequence in flight is kept (its `reserve` may be more than 0)."""
        return self._drops >= MAX_DROPS

    def keeps(self, lead: SequenceProgress) -> bool:
        """Whether the sequence (group) led by `lead` keeps its blocks until it is done."""
        return self._dropped == lead.sequence_id and self._drops >= MAX_DROPS

    def never_fits(self, seq: SequenceProgress) -> bool:
        """Whether the sequence needs more blocks than the whole cache has."""
        return -(-seq.length // self._kv.block_size) > self._kv.num_blocks

    def allocate(self, seq: SequenceProgress, lead: SequenceProgress, end: int) -> bool:
        """Blocks for positions [0, end) of `seq` (of all of it when its group is kept); False: none free."""
        return self._kv.allocate_slots(seq.sequence_id, seq.length if self.keeps(lead) else end)

    def table(self, sequence_id: str) -> list[int]:
        return self._kv.block_table(sequence_id)

    def free_now(self, sequence_id: str) -> None:
        self._kv.free(sequence_id)

    def release(self, group: Sequence[SequenceProgress], plan: IterationPlan) -> int:
        """Free the blocks of the group's started sequences (the engine drops their state in `plan`) and
        count the drop; 0 when the group is kept. The caller resets the sequences."""
        lead = group[0]
        if self.keeps(lead):
            return 0
        freed = 0
        for member in (s for s in group if s.started):
            freed += len(self._kv.block_table(member.sequence_id))
            self._kv.free(member.sequence_id)
            plan.training.sequence_drops.append(member.sequence_id)
        self._drops = self._drops + 1 if self._dropped == lead.sequence_id else 1
        self._dropped = lead.sequence_id
        if self._drops == MAX_DROPS:
            self.kept += 1
            self.kept_tokens = sum(s.length for s in group)
        return freed

    def reserve(self, group: Sequence[SequenceProgress]) -> int:
        """Blocks a kept group still needs (0 when it is not kept)."""
        if not group or not self.keeps(group[0]):
            return 0
        return sum(self._kv.blocks_needed(s.sequence_id, s.length) for s in group)

    def done(self, seq: SequenceProgress) -> None:
        """The sequence's last work is planned: free its blocks once that step ran; a hold on it ends."""
        self._to_free.append(seq.sequence_id)
        if self._dropped == seq.sequence_id:
            self._dropped, self._drops = None, 0

    def free_done(self) -> None:
        """Free the blocks of the sequences done in the step that just ran."""
        for sequence_id in self._to_free:
            self._kv.free(sequence_id)
        self._to_free.clear()

    def free_all(self, current: SequenceProgress | None) -> None:
        """The job ends: free every block it holds."""
        if current is not None:
            self._kv.free(current.sequence_id)
        self.free_done()
