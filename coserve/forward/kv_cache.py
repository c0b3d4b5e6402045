"""The paged KV cache tensors. Bookkeeping (which block belongs to whom) lives in the scheduler's
`coserve.inference.kv_blocks.KVBlockManager`; the engine only writes and reads the slots it is told.

Layout: one tensor per layer for K and one for V, each [num_blocks * block_size, kv_heads, head_dim]
("slots"). Position p of a sequence lives in slot `block_table[p // block_size] * block_size +
p % block_size`.
"""

from __future__ import annotations

import torch


class KVCache:
    """Preallocated K/V slots for every layer."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        shape = (num_layers, num_blocks * block_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype) -> int:
        element = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * block_size * num_kv_heads * head_dim * element

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v [T, kv_heads, head_dim] at `slots` [T]."""
        self.k[layer].index_copy_(0, slots, k)
        self.v[layer].index_copy_(0, slots, v)

    def blocks(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one layer viewed as [num_blocks, block_size, kv_heads, head_dim]."""
        shape = (self.num_blocks, self.block_size) + tuple(self.k.shape[2:])
        return self.k[layer].view(shape), self.v[layer].view(shape)
