"""Retained KV: free cached blocks a finished request asked to keep for a while (a stored response whose
conversation may be continued: its next turn then prefills only its new tokens).

A retained block is free: it counts in `KVBlockManager.num_free_blocks` and is given to any allocation that
needs it, so retention never makes a request wait or be preempted. It is only protected from the ordinary
prefix-cache churn: an allocation takes plain free blocks first, then cached blocks nobody asked to keep
(least recently used first), and retained ones last (the oldest first). Retention is bounded twice: each
block is kept until its deadline (`retain_s` after its request ended, then it is an ordinary cached
block), and at most `max_blocks` are retained at once (past that the oldest become ordinary cached blocks).
"""

from __future__ import annotations

from collections import OrderedDict


class RetainedBlocks:
    """Free cached blocks kept until a deadline, oldest first.

    Args:
        max_blocks: the most blocks retained at once (0: retention off).
    """

    def __init__(self, max_blocks: int) -> None:
        if max_blocks < 0:
            raise ValueError(f"max_blocks must be >= 0, got {max_blocks}")
        self.max_blocks = max_blocks
        self._deadlines: OrderedDict[int, float] = OrderedDict()  # block -> when it stops being retained

    def __len__(self) -> int:
        return len(self._deadlines)

    def __contains__(self, block: int) -> bool:
        return block in self._deadlines

    def add(self, block: int, deadline: float) -> list[int]:
        """Retain `block` until `deadline`; returns the blocks that stop being retained to stay within
        `max_blocks` (the oldest; `block` itself when retention is off)."""
        if self.max_blocks == 0:
            return [block]
        self._deadlines[block] = deadline
        dropped = []
        while len(self._deadlines) > self.max_blocks:
            oldest, _ = self._deadlines.popitem(last=False)
            dropped.append(oldest)
        return dropped

    def remove(self, block: int) -> None:
        """`block` is in use again (a later request matched it)."""
        del self._deadlines[block]

    def expired(self, now: float) -> list[int]:
        """Take out and return the blocks whose deadline has passed, oldest first, stopping at the first
        one still retained (deadlines follow retention order when requests keep their KV equally long;
        a longer one ahead only delays the ones behind it, within `max_blocks`)."""
        done = []
        for block, deadline in self._deadlines.items():
            if deadline > now:
                break
            done.append(block)
        for block in done:
            del self._deadlines[block]
        return done

    def pop_oldest(self) -> int:
        """Take out the block retained longest (an allocation found no other free block)."""
        block, _ = self._deadlines.popitem(last=False)
        return block
