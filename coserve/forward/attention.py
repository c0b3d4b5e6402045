"""Attention over the paged KV cache for a ragged batch.

The batch is flattened: every scheduled token is one row. Rows are ordered so that the single-token
chunks (decodes) come first; they attend in one batched call over their gathered blocks. Multi-token
chunks (prefill chunks, fine-tuning windows) attend one sequence at a time with causal masking inside
the chunk; a chunk that starts at position 0 attends to its own fresh K/V without touching the cache.

With the native decode kernel, short chunks go with the decodes (`attends_row_wise`): each of their
rows is a decode of its own position over the sequence's blocks (its own K/V are written to the cache
before attention, so that is exact causal attention). A fine-tuning window of a few tokens riding
along a decode batch spent 2.2 ms per iteration (8 layers, small preset) in the per-chunk path's
gathers and masked SDPA; as 4 more decode rows it costs the kernel a few more dot products. Chunks
whose whole context is short (a prefill of a short prompt) go row by row too: the per-chunk path is
one SDPA call per sequence and layer, and a batch of 32 prompts of 48-80 tokens (SmolLM2 shapes) took
25 ms per layer that way, 14 ms as one kernel call (1 thread); with 2 threads on a busy 2-core machine
each of those 32 calls is a parallel region that waits for a descheduled thread: 91 ms mean vs 12 ms.
Deep contexts stay with SDPA, whose blocked matmuls win there (a 128-token chunk at position 1024:
13 ms vs 23 ms row by row).

Metadata is built once per iteration and shared by every layer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from coserve.forward.kv_cache import KVCache
from coserve.forward.native import PagedDecode

ROW_WISE_MAX_TOKENS = 8  # chunks this short attend row by row with the decodes (native kernel only)
# Chunks whose context ends within this many positions attend row by row too (native kernel only):
# measured on SmolLM2 shapes (9 heads, 3 KV heads, d 64), one fresh 512-token prefill took 26 ms row
# by row vs 38 ms through SDPA, 256 tokens 2.5 vs 8.3 ms.
ROW_WISE_MAX_CONTEXT = 512


def attends_row_wise(start: int, num_tokens: int, decode_kernel: PagedDecode | None) -> bool:
    """Whether `build_metadata` treats a chunk of `num_tokens` rows from position `start` as decode
    rows: a single token always; with the native kernel also a short chunk or a short context."""
    if decode_kernel is None:
        return num_tokens == 1
    return num_tokens <= ROW_WISE_MAX_TOKENS or start + num_tokens <= ROW_WISE_MAX_CONTEXT


@dataclass(slots=True)
class ChunkSpan:
    """One sequence's rows in the flattened batch."""

    row: int  # first row
    start: int  # position of the first row
    num_tokens: int
    block_table: Sequence[int]


@dataclass(slots=True)
class PrefillSpan:
    row: int
    num_tokens: int
    blocks: torch.Tensor | None  # [num_blocks_covering_context], None when start == 0
    context_len: int
    mask: torch.Tensor | None  # [num_tokens, context_len] bool (True = attend), None when start == 0
    # The blocks are 0, 1, 2, ... (always so in the trainer's dense K/V, block size 1): the context is
    # a slice of the store, not a gather, which autograd would undo with a zero-filled scatter.
    leading_blocks: bool = False


@dataclass(slots=True)
class AttentionMetadata:
    """Everything the attention of one iteration needs, for all layers."""

    positions: torch.Tensor  # [T]
    slots: torch.Tensor  # [T] KV slot of each row
    num_decodes: int  # rows [0, num_decodes) are single-token chunks
    decode_blocks: torch.Tensor | None  # [num_decodes, max_blocks], padded with block 0
    decode_mask: torch.Tensor | None  # [num_decodes, 1, 1, max_blocks * block_size] bool
    decode_lens: torch.Tensor | None  # [num_decodes] context length of each decode
    prefills: list[PrefillSpan]
    block_size: int
    decode_kernel: PagedDecode | None  # native CPU kernel for the decodes; None: torch gather+SDPA


def build_metadata(spans: list[ChunkSpan], block_size: int, device: torch.device,
                   decode_kernel: PagedDecode | None = None) -> AttentionMetadata:
    """Build the per-iteration metadata. `spans` must list the chunks that `attends_row_wise` first:
    their rows are the decode rows."""
    starts = torch.tensor([s.start for s in spans], dtype=torch.int64)
    lens = torch.tensor([s.num_tokens for s in spans], dtype=torch.int64)
    total = int(lens.sum())
    seq_of_row = torch.repeat_interleave(torch.arange(len(spans)), lens)
    first_row = torch.cumsum(lens, 0) - lens
    positions = starts[seq_of_row] + torch.arange(total) - first_row[seq_of_row]
    width = max(len(s.block_table) for s in spans)
    tables = torch.tensor([[*s.block_table, *[0] * (width - len(s.block_table))] for s in spans],
                          dtype=torch.int64)
    slots = tables[seq_of_row, positions // block_size] * block_size + positions % block_size

    num_row_wise = 0
    while num_row_wise < len(spans) and attends_row_wise(spans[num_row_wise].start,
                                                        spans[num_row_wise].num_tokens, decode_kernel):
        num_row_wise += 1
    num_decodes = int(lens[:num_row_wise].sum())  # rows: one per token of those chunks
    decode_blocks = decode_mask = decode_lens = None
    if num_decodes:
        decode_lens = positions[:num_decodes] + 1
        nblocks = int((decode_lens.max() + block_size - 1) // block_size)
        decode_blocks = tables[seq_of_row[:num_decodes], :nblocks].contiguous().to(device)
        if decode_kernel is None:  # the torch path masks the padding of its gathered blocks
            keys = torch.arange(nblocks * block_size)
            decode_mask = (keys[None, :] < decode_lens[:, None]).view(num_decodes, 1, 1, -1).to(device)
    prefills = [_prefill_span(s, block_size, device) for s in spans[num_row_wise:]]
    return AttentionMetadata(positions=positions.to(device), slots=slots.to(device),
                             num_decodes=num_decodes, decode_blocks=decode_blocks,
                             decode_mask=decode_mask, decode_lens=decode_lens, prefills=prefills,
                             block_size=block_size, decode_kernel=decode_kernel)


def _prefill_span(span: ChunkSpan, block_size: int, device: torch.device) -> PrefillSpan:
    context = span.start + span.num_tokens
    if span.start == 0:
        return PrefillSpan(span.row, span.num_tokens, None, context, None)
    nblocks = (context + block_size - 1) // block_size
    table = span.block_table[:nblocks]
    blocks = torch.tensor(table, dtype=torch.int64, device=device)
    query_pos = torch.arange(span.start, context, device=device)
    mask = torch.arange(context, device=device)[None, :] <= query_pos[:, None]
    leading = table[0] == 0 and table[-1] == nblocks - 1 and list(table) == list(range(nblocks))
    return PrefillSpan(span.row, span.num_tokens, blocks, context, mask, leading)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache, layer: int,
                    meta: AttentionMetadata) -> torch.Tensor:
    """Causal attention of every row over its sequence's context.

    Args:
        q: [T, heads, head_dim]; k, v: [T, kv_heads, head_dim] of this iteration's rows (already
            written to the cache at `meta.slots`).
    Returns:
        [T, heads * head_dim]
    """
    out = torch.empty_like(q)
    k_blocks, v_blocks = cache.blocks(layer)
    nd = meta.num_decodes
    if nd and meta.decode_kernel is not None:
        assert meta.decode_blocks is not None and meta.decode_lens is not None  # set whenever there are decodes
        meta.decode_kernel(q[:nd].contiguous(), cache.k[layer], cache.v[layer], meta.decode_blocks,
                           meta.decode_lens, out, meta.block_size)
    elif nd:
        out[:nd] = _decode_attention(q[:nd], k_blocks, v_blocks, meta)
    for span in meta.prefills:
        rows = slice(span.row, span.row + span.num_tokens)
        if span.blocks is None:
            keys, values, mask = k[rows], v[rows], None
        else:
            keys, values = _context(k_blocks, span), _context(v_blocks, span)
            mask = span.mask
        out[rows] = _sdpa(q[rows].transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),
                          mask, causal=mask is None).transpose(0, 1)
    return out.flatten(1)


def _context(blocks: torch.Tensor, span: PrefillSpan) -> torch.Tensor:
    """The K (or V) of positions [0, span.context_len) of the span's sequence, [context, kv_heads, d]."""
    if span.leading_blocks:
        flat = blocks.flatten(0, 1)
        return flat if flat.shape[0] == span.context_len else flat[: span.context_len]
    return blocks[span.blocks].flatten(0, 1)[: span.context_len]


def _decode_attention(q: torch.Tensor, k_blocks: torch.Tensor, v_blocks: torch.Tensor,
                      meta: AttentionMetadata) -> torch.Tensor:
    # [nd, max_blocks, block_size, kv_heads, d] -> [nd, kv_heads, max_blocks * block_size, d]
    keys = k_blocks[meta.decode_blocks].flatten(1, 2).transpose(1, 2)
    values = v_blocks[meta.decode_blocks].flatten(1, 2).transpose(1, 2)
    out = _sdpa(q.unsqueeze(2), keys, values, meta.decode_mask, causal=False)
    return out.squeeze(2)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
          causal: bool) -> torch.Tensor:
    """SDPA with grouped-query heads: q [..., heads, L, d], k/v [..., kv_heads, S, d]."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                          enable_gqa=q.shape[-3] != k.shape[-3])
