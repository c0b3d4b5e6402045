"""Token masks of the sampler: which tokens some rows of a batch may sample (structured output).

A mask is a bitmask, one int32 word per 32 token ids (llguidance's layout), for a subset of the batch's
rows. The sampler unpacks it on the logits' device and applies it to all masked rows in one
`masked_fill`: no Python loop over the vocabulary or over rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BITS = 32  # token ids per int32 word of a bitmask row


@dataclass(slots=True)
class TokenMask:
    """Which tokens some rows of a batch may sample.

    Args:
        rows: the batch rows the mask applies to (the other rows are unconstrained).
        bitmask: `[len(rows), ceil(V / 32)]` int32; bit `t % 32` of word `t // 32` set means token t
            is allowed.
    """

    rows: list[int]
    bitmask: torch.Tensor


def words_for(vocab_size: int) -> int:
    """int32 words of one bitmask row."""
    return (vocab_size + BITS - 1) // BITS


def bitmask_from_allowed(allowed: list[list[int]], vocab_size: int) -> torch.Tensor:
    """The bitmask rows allowing exactly the given token ids (tests and hand-built masks)."""
    dense = torch.zeros((len(allowed), words_for(vocab_size) * BITS), dtype=torch.bool)
    for j, ids in enumerate(allowed):
        dense[j, ids] = True
    weights = torch.tensor([1 << k for k in range(BITS)], dtype=torch.int64)
    words = (dense.view(len(allowed), -1, BITS).long() * weights).sum(dim=-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """`[R, W]` int32 bitmask -> `[R, vocab_size]` bool (True: allowed), on the bitmask's device."""
    shifts = torch.arange(BITS, dtype=torch.int32, device=bitmask.device)
    # An arithmetic shift then `& 1` reads bit k of a two's-complement word, the sign bit included.
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_token_mask(logits: torch.Tensor, mask: TokenMask) -> None:
    """Set the logits of the tokens `mask` forbids to -inf, in place, for its rows only."""
    allowed = unpack_bitmask(mask.bitmask.to(logits.device, non_blocking=True), logits.shape[1])
    idx = torch.tensor(mask.rows, dtype=torch.long, device=logits.device)
    logits[idx] = logits[idx].masked_fill(~allowed, float("-inf"))
