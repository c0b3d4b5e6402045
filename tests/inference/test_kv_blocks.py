"""KVBlockManager: allocation, freeing, prefix caching and its invariants."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coserve.inference import kv_blocks
from coserve.inference.kv_blocks import KVBlockManager

BS = 4


def _cached_request(kv: KVBlockManager, request_id: str, tokens: list[int], salt: int = 0) -> None:
    """A request that computed all of `tokens` and registered its full blocks."""
    kv.match_prefix(request_id, tokens, salt)
    assert kv.allocate_slots(request_id, len(tokens))
    kv.cache_full_blocks(request_id, tokens, len(tokens), salt)


# ------------------------------------------------------------------------------------ allocation

def test_allocate_grows_table_block_by_block() -> None:
    kv = KVBlockManager(num_blocks=8, block_size=BS)
    assert kv.allocate_slots("a", 1)
    assert len(kv.block_table("a")) == 1
    assert kv.allocate_slots("a", 4)  # still fits in the first block
    assert len(kv.block_table("a")) == 1
    assert kv.allocate_slots("a", 5)
    table = kv.block_table("a")
    assert len(table) == 2 and len(set(table)) == 2
    assert kv.num_free_blocks == 6
    assert kv.usage == pytest.approx(2 / 8)
    assert kv.blocks_needed("a", 13) == 2
    assert kv.blocks_needed("a", 3) == 0


def test_block_table_is_a_copy() -> None:
    kv = KVBlockManager(num_blocks=4, block_size=BS)
    kv.allocate_slots("a", 4)
    table = kv.block_table("a")
    table.append(99)
    assert kv.block_table("a") == table[:1]


def test_does_not_fit_returns_false_and_changes_nothing() -> None:
    kv = KVBlockManager(num_blocks=4, block_size=BS)
    assert kv.allocate_slots("a", 8)
    before = (kv.block_table("a"), kv.num_free_blocks)
    assert not kv.can_allocate("a", 17)
    assert not kv.allocate_slots("a", 17)  # needs 5 blocks, has 2 + 2 free
    assert not kv.allocate_slots("b", 12)
    assert (kv.block_table("a"), kv.num_free_blocks) == before
    assert not kv.has_table("b")


def test_free_returns_blocks_and_is_idempotent() -> None:
    kv = KVBlockManager(num_blocks=4, block_size=BS)
    kv.allocate_slots("a", 16)
    assert kv.num_free_blocks == 0
    kv.free("a")
    kv.free("a")
    kv.free("never-seen")
    assert kv.num_free_blocks == 4
    assert kv.block_table("a") == []


def test_bad_arguments_raise() -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        KVBlockManager(num_blocks=0, block_size=BS)
    with pytest.raises(ValueError, match="block_size"):
        KVBlockManager(num_blocks=1, block_size=0)
    kv = KVBlockManager(num_blocks=4, block_size=BS)
    with pytest.raises(ValueError, match="-1"):
        kv.allocate_slots("a", -1)
    with pytest.raises(ValueError, match="holds no blocks"):
        kv.cache_full_blocks("a", [1, 2, 3, 4], 4, 0)


# ---------------------------------------------------------------------------------- prefix cache

def test_prefix_hit_shares_blocks_with_ref_counting() -> None:
    kv = KVBlockManager(num_blocks=8, block_size=BS)
    prompt = list(range(10))  # 2 full blocks + 2 tokens
    _cached_request(kv, "a", prompt)
    assert kv.match_prefix("b", prompt, 0) == 8
    assert kv.block_table("b") == kv.block_table("a")[:2]
    assert kv.stats.hit_tokens == 8
    assert kv.allocate_slots("b", 10)
    assert kv.block_table("b")[2] != kv.block_table("a")[2]  # the partial block stays private
    free_before = kv.num_free_blocks
    kv.free("a")  # shared blocks are still held by b; only a's private tail is released
    assert kv.num_free_blocks == free_before + 1
    assert kv.match_prefix("c", prompt, 0) == 8  # still cached and in use by b
    kv.free("b")
    kv.free("c")
    assert kv.num_free_blocks == 8


def test_at_least_one_token_is_left_to_compute() -> None:
    kv = KVBlockManager(num_blocks=8, block_size=BS)
    prompt = list(range(8))  # exactly 2 full blocks
    _cached_request(kv, "a", prompt)
    assert kv.match_prefix("b", prompt, 0) == 4  # the second block is dropped
    assert kv.match_prefix("c", prompt + [99], 0) == 8  # a ninth token lets both blocks match
    assert kv.match_prefix("d", prompt[:1], 0) == 0


def test_salt_isolates_adapters() -> None:
    kv = KVBlockManager(num_blocks=8, block_size=BS)
    prompt = list(range(9))
    _cached_request(kv, "a", prompt, salt=1)
    assert kv.match_prefix("b", prompt, 2) == 0
    assert kv.match_prefix("c", prompt, 1) == 8


def test_different_first_block_breaks_the_chain() -> None:
    kv = KVBlockManager(num_blocks=8, block_size=BS)
    _cached_request(kv, "a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    # Same second block, different first: the chained hash must not match the second block alone.
    assert kv.match_prefix("b", [0, 2, 3, 4, 5, 6, 7, 8, 9], 0) == 0


def test_hash_collision_is_not_a_hit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kv_blocks, "hash_block", lambda parent, tokens, salt: 7)
    kv = KVBlockManager(num_blocks=8, block_size=BS)
    _cached_request(kv, "a", [1, 2, 3, 4, 5])
    assert kv.match_prefix("b", [9, 9, 9, 9, 5], 0) == 0  # same hash, other tokens
    assert kv.match_prefix("c", [1, 2, 3, 4, 5], 0) == 4


def test_freed_cached_blocks_are_reusable_until_evicted() -> None:
    kv = KVBlockManager(num_blocks=4, block_size=BS)
    prompt = list(range(9))
    _cached_request(kv, "a", prompt)
    kv.free("a")
    assert kv.num_free_blocks == 4 and kv.num_cached_free_blocks == 2
    assert kv.match_prefix("b", prompt, 0) == 8
    assert kv.num_free_blocks == 2  # taking cached free blocks back makes them used again
    kv.free("b")
    # Plain free blocks go first: two requests of one block each evict nothing.
    assert kv.allocate_slots("x", 4) and kv.allocate_slots("y", 4)
    assert kv.num_cached_free_blocks == 2
    assert kv.allocate_slots("z", 4)  # now one cached block is evicted
    assert kv.num_cached_free_blocks == 1
    assert kv.match_prefix("c", prompt, 0) == 4  # tail freed first, so it was evicted first
    kv.free("c")
    assert kv.allocate_slots("w", 4)
    assert kv.match_prefix("d", prompt, 0) == 0  # everything cached is gone
    assert kv.num_free_blocks == 0


def test_duplicate_content_keeps_the_first_copy() -> None:
    kv = KVBlockManager(num_blocks=8, block_size=BS)
    prompt = list(range(5))
    for request_id in ("a", "b"):  # both computed the same block concurrently, no hit for b
        kv.match_prefix(request_id, prompt, 0)
        kv.allocate_slots(request_id, 5)
    kv.cache_full_blocks("a", prompt, 5, 0)
    kv.cache_full_blocks("b", prompt, 5, 0)
    kv.free("b")
    assert kv.num_cached_free_blocks == 0  # b's copy was never registered
    assert kv.match_prefix("c", prompt, 0) == 4
    assert kv.block_table("c") == kv.block_table("a")[:1]


def test_prefix_caching_off_finds_nothing() -> None:
    kv = KVBlockManager(num_blocks=8, block_size=BS, enable_prefix_caching=False)
    prompt = list(range(9))
    _cached_request(kv, "a", prompt)
    kv.free("a")
    assert kv.num_cached_free_blocks == 0
    assert kv.match_prefix("b", prompt, 0) == 0


def test_match_prefix_needs_a_fresh_request() -> None:
    kv = KVBlockManager(num_blocks=8, block_size=BS)
    kv.allocate_slots("a", 3)
    with pytest.raises(ValueError, match="'a'"):
        kv.match_prefix("a", [1, 2, 3], 0)


# ------------------------------------------------------------------------------ property test

_PROMPTS = [  # overlapping prompts, so random sequences share and evict prefixes
    [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11],
    [1, 2, 3, 4, 5, 6, 7, 8, 20, 21],
    [1, 2, 3, 4, 30, 31, 32, 33, 34],
    [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52],
]


@dataclass
class _Model:
    """What each live request holds, and what each physical block was computed with."""

    tokens: dict[str, list[int]] = field(default_factory=dict)
    salt: dict[str, int] = field(default_factory=dict)
    computed: dict[str, int] = field(default_factory=dict)
    content: dict[int, tuple[int, tuple[int, ...]]] = field(default_factory=dict)


def _op_start(kv: KVBlockManager, model: _Model, rid: str, prompt: int, salt: int, extra: int) -> None:
    if kv.has_table(rid):
        return
    tokens = _PROMPTS[prompt]
    cached = kv.match_prefix(rid, tokens, salt)
    assert cached % BS == 0 and cached < len(tokens)
    for index, block in enumerate(kv.block_table(rid)):  # a hit must hold exactly these K/V
        assert model.content[block] == (salt, tuple(tokens[:(index + 1) * BS]))
    model.tokens[rid], model.salt[rid], model.computed[rid] = tokens, salt, cached
    _op_grow(kv, model, rid, extra)


def _op_grow(kv: KVBlockManager, model: _Model, rid: str, extra: int) -> None:
    if rid not in model.tokens:
        return
    old_table = kv.block_table(rid)
    target = min(len(model.tokens[rid]), model.computed[rid] + extra)
    if not kv.allocate_slots(rid, target):
        assert kv.block_table(rid) == old_table
        return
    for block in kv.block_table(rid)[len(old_table):]:
        model.content.pop(block, None)  # a fresh block's old K/V are overwritten
    tokens, salt = model.tokens[rid], model.salt[rid]
    for index in range(model.computed[rid] // BS, target // BS):
        block = kv.block_table(rid)[index]
        model.content.setdefault(block, (salt, tuple(tokens[:(index + 1) * BS])))
    model.computed[rid] = target
    kv.cache_full_blocks(rid, tokens, target, salt)


def _op_free(kv: KVBlockManager, model: _Model, rid: str) -> None:
    kv.free(rid)
    for table in (model.tokens, model.salt, model.computed):
        table.pop(rid, None)


def _check_consistency(kv: KVBlockManager, model: _Model) -> None:
    owners: dict[int, list[tuple[str, int]]] = {}
    for rid in model.tokens:
        table = kv.block_table(rid)
        assert len(table) == len(set(table)), f"{rid} holds a block twice: {table}"
        for index, block in enumerate(table):
            owners.setdefault(block, []).append((rid, index))
    for block, holders in owners.items():
        # A block in use by several requests must be a shared full prefix of all of them.
        prefixes = {(model.salt[r], tuple(model.tokens[r][:(i + 1) * BS])) for r, i in holders}
        if len(holders) > 1:
            assert len(prefixes) == 1, f"block {block} double-assigned: {holders}"
            assert all((i + 1) * BS <= model.computed[r] for r, i in holders)
    assert len(owners) + kv.num_free_blocks == kv.num_blocks


_OPS = st.one_of(
    st.tuples(st.just(0), st.integers(0, 3), st.integers(0, 3), st.integers(0, 1), st.integers(1, 13)),
    st.tuples(st.just(1), st.integers(0, 3), st.just(0), st.just(0), st.integers(1, 6)),
    st.tuples(st.just(2), st.integers(0, 3), st.just(0), st.just(0), st.just(0)),
)


@settings(max_examples=150, deadline=None)
@given(ops=st.lists(_OPS, max_size=40), num_blocks=st.integers(3, 8))
def test_random_operations_keep_blocks_consistent(ops: list[tuple[int, int, int, int, int]],
                                                  num_blocks: int) -> None:
    kv = KVBlockManager(num_blocks=num_blocks, block_size=BS)
    model = _Model()
    for kind, request, prompt, salt, extra in ops:
        rid = f"r{request}"
        if kind == 0:
            _op_start(kv, model, rid, prompt, salt, extra)
        elif kind == 1:
            _op_grow(kv, model, rid, extra)
        else:
            _op_free(kv, model, rid)
        _check_consistency(kv, model)
