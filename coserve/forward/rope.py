"""Rotary position embeddings (the rotate-half convention of HF Llama/Qwen/Mistral).

The cos/sin tables are computed once for every position up to the context length, in float32 as
transformers does, and gathered by position each iteration.
"""

from __future__ import annotations

import torch

from coserve.model.config import RopeConfig
from coserve.model.rope_frequencies import inverse_frequencies


class RotaryTable:
    """cos/sin for positions [0, max_positions), in the model dtype, on the model device."""

    def __init__(self, rope: RopeConfig, head_dim: int, max_positions: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        inv_freq = inverse_frequencies(rope, head_dim)
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = emb.cos().to(device=device, dtype=dtype)  # [max_positions, head_dim]
        # HF's rotate_half(x) * sin == cat(x2, x1) * cat(-sin, sin): folding the sign into the table
        # saves a negation per call and gives the same bits.
        sin = emb.sin()
        half = head_dim // 2
        self.signed_sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1).to(device=device,
                                                                                  dtype=dtype)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin of shape [T, 1, head_dim], broadcastable over heads."""
        return self.cos[positions].unsqueeze(1), self.signed_sin[positions].unsqueeze(1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, heads, head_dim] by the positions' angles (tables from `RotaryTable.lookup`)."""
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    return x * cos + swapped * signed_sin
