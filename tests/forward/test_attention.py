"""Paged attention: the native decode kernel and the torch path agree with dense causal attention."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import coserve.forward.attention as attention
from coserve.forward.attention import (
    ROW_WISE_MAX_CONTEXT,
    ROW_WISE_MAX_TOKENS,
    ChunkSpan,
    attends_row_wise,
    build_metadata,
    paged_attention,
)
from coserve.forward.kv_cache import KVCache
from coserve.forward.native import load_paged_decode

BLOCK = 4


def _dense_reference(q_rows: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                     positions: torch.Tensor) -> torch.Tensor:
    """Row i attends to keys[: positions[i] + 1] of its own sequence."""
    heads, kv_heads = q_rows.shape[1], keys.shape[1]
    k = keys.repeat_interleave(heads // kv_heads, dim=1).transpose(0, 1)
    v = values.repeat_interleave(heads // kv_heads, dim=1).transpose(0, 1)
    mask = torch.arange(keys.shape[0])[None, :] <= positions[:, None]
    out = F.scaled_dot_product_attention(q_rows.transpose(0, 1), k, v, attn_mask=mask)
    return out.transpose(0, 1)


@pytest.mark.parametrize("heads, kv_heads", [(4, 1), (4, 2), (4, 4), (8, 2)])
@pytest.mark.parametrize("native, max_context", [(True, 8), (True, ROW_WISE_MAX_CONTEXT), (False, 8)])
def test_mixed_batch_matches_dense_attention(heads: int, kv_heads: int, native: bool, max_context: int,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    kernel = load_paged_decode() if native else None
    if native and kernel is None:
        pytest.skip("no C compiler: the native kernel is unavailable")
    # With max_context 8 the last chunk takes the per-chunk SDPA path; by default every chunk here
    # has a short context, so with the kernel the whole batch attends row by row.
    monkeypatch.setattr(attention, "ROW_WISE_MAX_CONTEXT", max_context)
    g = torch.Generator().manual_seed(heads * 10 + kv_heads)
    dim, num_blocks = 32, 64
    # (start, num_tokens, full length): two decodes, a fresh prefill, a prefill chunk after a prefix
    # (both short: with the kernel they attend row by row), and a chunk too long for that.
    layout = [(9, 1, 10), (2, 1, 3), (0, 7, 7), (6, 5, 11), (3, 12, 15)]
    perm = torch.randperm(num_blocks, generator=g).tolist()
    cache = KVCache(1, num_blocks, BLOCK, kv_heads, dim, torch.float32, torch.device("cpu"))
    full_k = [torch.randn(n, kv_heads, dim, generator=g) for _, _, n in layout]
    full_v = [torch.randn(n, kv_heads, dim, generator=g) for _, _, n in layout]
    spans, row, q_parts, k_new, v_new = [], 0, [], [], []
    for i, (start, count, length) in enumerate(layout):
        table = perm[i * 4: i * 4 + (length + BLOCK - 1) // BLOCK]
        spans.append(ChunkSpan(row, start, count, table))
        row += count
        # The earlier positions' K/V are already in the cache.
        slots = torch.tensor([table[p // BLOCK] * BLOCK + p % BLOCK for p in range(start)], dtype=torch.int64)
        if start:
            cache.write(0, slots, full_k[i][:start], full_v[i][:start])
        q_parts.append(torch.randn(count, heads, dim, generator=g))
        k_new.append(full_k[i][start: start + count])
        v_new.append(full_v[i][start: start + count])
    meta = build_metadata(spans, BLOCK, torch.device("cpu"), kernel)
    q, k, v = torch.cat(q_parts), torch.cat(k_new), torch.cat(v_new)
    cache.write(0, meta.slots, k, v)
    out = paged_attention(q, k, v, cache, 0, meta).view(-1, heads, dim)
    for span, q_rows, (start, count, _length), keys, values in zip(spans, q_parts, layout, full_k, full_v):
        positions = torch.arange(start, start + count)
        expected = _dense_reference(q_rows, keys, values, positions)
        # softmax(q k^T) v over <= 64 keys of unit-scale entries, paged and blocked against dense: (4 + 64) u of
        # the output's scale ~1 for the weights' sum, 2 sqrt(dim) u for each dot product: within 1e-5
        torch.testing.assert_close(out[span.row: span.row + count], expected, atol=1e-5, rtol=1e-5)


def test_metadata_orders_decodes_first_and_maps_slots() -> None:
    spans = [ChunkSpan(0, 5, 1, [3, 7]), ChunkSpan(1, 0, 3, [2])]
    meta = build_metadata(spans, BLOCK, torch.device("cpu"))
    assert meta.num_decodes == 1
    assert meta.positions.tolist() == [5, 0, 1, 2]
    assert meta.slots.tolist() == [7 * BLOCK + 1, 2 * BLOCK, 2 * BLOCK + 1, 2 * BLOCK + 2]
    assert meta.decode_lens.tolist() == [6]


def test_with_the_kernel_short_chunks_become_decode_rows() -> None:
    kernel = load_paged_decode()
    if kernel is None:
        pytest.skip("no C compiler: the native kernel is unavailable")
    assert attends_row_wise(5, 1, None) and not attends_row_wise(0, 2, None)
    assert attends_row_wise(1000, ROW_WISE_MAX_TOKENS, kernel)
    long = ROW_WISE_MAX_TOKENS + 1
    assert not attends_row_wise(ROW_WISE_MAX_CONTEXT, long, kernel)
    table = list(range(20, 20 + (ROW_WISE_MAX_CONTEXT + long + BLOCK - 1) // BLOCK))
    spans = [ChunkSpan(0, 5, 1, [3, 7]), ChunkSpan(1, 2, 3, [9, 4]),
             ChunkSpan(4, ROW_WISE_MAX_CONTEXT, long, table)]
    meta = build_metadata(spans, BLOCK, torch.device("cpu"), kernel)
    assert meta.num_decodes == 4  # the decode and the 3 rows of the short chunk
    assert meta.decode_lens.tolist() == [6, 3, 4, 5]
    assert meta.decode_blocks.tolist() == [[3, 7], [9, 4], [9, 4], [9, 4]]
    assert [(p.row, p.num_tokens) for p in meta.prefills] == [(4, long)]
    torch_path = build_metadata(spans, BLOCK, torch.device("cpu"))
    assert torch_path.num_decodes == 1 and len(torch_path.prefills) == 2


def test_with_the_kernel_a_short_context_prefill_becomes_decode_rows() -> None:
    """A whole prompt whose context fits ROW_WISE_MAX_CONTEXT is one kernel call, not an SDPA per
    sequence; a chunk of the same length deeper in its sequence stays with SDPA."""
    kernel = load_paged_decode()
    if kernel is None:
        pytest.skip("no C compiler: the native kernel is unavailable")
    count = ROW_WISE_MAX_TOKENS * 4
    assert attends_row_wise(0, count, kernel) and not attends_row_wise(0, count, None)
    assert attends_row_wise(ROW_WISE_MAX_CONTEXT - count, count, kernel)
    assert not attends_row_wise(ROW_WISE_MAX_CONTEXT - count + 1, count, kernel)
    spans = [ChunkSpan(0, 0, count, list(range(count // BLOCK)))]
    meta = build_metadata(spans, BLOCK, torch.device("cpu"), kernel)
    assert meta.num_decodes == count and meta.prefills == []
    assert meta.decode_lens.tolist() == list(range(1, count + 1))


def test_native_kernel_is_identical_on_any_thread_count() -> None:
    kernel = load_paged_decode()
    if kernel is None:
        pytest.skip("no C compiler: the native kernel is unavailable")
    g = torch.Generator().manual_seed(0)
    batch, heads, kv_heads, dim, num_blocks = 9, 8, 2, 64, 40
    k_slots = torch.randn(num_blocks * BLOCK, kv_heads, dim, generator=g)
    v_slots = torch.randn(num_blocks * BLOCK, kv_heads, dim, generator=g)
    tables = torch.randperm(num_blocks, generator=g)[: batch * 4].view(batch, 4).contiguous()
    lens = torch.randint(1, 4 * BLOCK + 1, (batch,), generator=g)
    q = torch.randn(batch, heads, dim, generator=g)
    outs = []
    previous = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            out = torch.empty_like(q)
            kernel(q, k_slots, v_slots, tables, lens, out, BLOCK)
            outs.append(out)
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(outs[0], outs[1])


def test_loading_the_kernel_keeps_ieee_denormals() -> None:
    """Built with -ffast-math, the library would switch the whole process to flush-to-zero."""
    if load_paged_decode() is None:
        pytest.skip("no C compiler: the native kernel is unavailable")
    tiny = torch.tensor([1e-40], dtype=torch.float32)
    assert float(tiny * 1.0) != 0.0
