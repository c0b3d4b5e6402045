"""Paged KV-cache bookkeeping: which physical blocks hold which request's positions.

The engine owns the K/V tensors; this module only decides block ids. It never imports torch.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from coserve.inference.kv_retention import RetainedBlocks
from coserve.inference.prefix_hashes import ROOT_HASH, PrefixHashes, hash_block


@dataclass(slots=True, frozen=True)
class _BlockKey:
    """What a cached block holds; compared on a hash hit so a collision can never alias K/V."""

    parent_hash: int
    tokens: tuple[int, ...]
    salt: int


@dataclass(slots=True)
class PrefixCacheStats:
    """Prefix-cache counters since construction (tokens, not blocks)."""

    queries: int = 0
    queried_tokens: int = 0
    hit_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


class KVBlockManager:
    """Maps each request's token positions to fixed-size physical KV blocks, with prefix caching.

    Position ``p`` of a request lives in ``block_table[p // block_size]`` at offset ``p % block_size``::

        tokens:  | t0 t1 t2 t3 | t4 t5 t6 t7 | t8 t9 .. .. |
        table:   [    17     ,     4       ,     9       ]    block_size = 4
                 |<- full, hashed, shareable ->|<- partial: private to the request ->|
                 h0 = hash(ROOT, (t0..t3), salt)
                 h1 = hash(h0,   (t4..t7), salt)         the chain makes h1 depend on t0..t7

    Only full blocks are ever shared. A physical block is in exactly one of three states:

    - **in use**: ref count >= 1; listed in the tables of the requests that hold it (more than one
      only for cached full blocks matched by ``match_prefix``);
    - **free, plain**: ref count 0, holds nothing reusable; handed out first;
    - **free, cached**: ref count 0 but its hash entry is kept, so a later request with the same
      prefix can take it back; kept in LRU order and evicted (hash dropped) only when allocation
      runs out of plain free blocks.

    ``num_free_blocks`` counts both free kinds: a cached free block is as allocatable as a plain one.

    Args:
        num_blocks: physical blocks in the engine's KV cache.
        block_size: token positions per block.
        enable_prefix_caching: when False, ``match_prefix`` finds nothing and ``cache_full_blocks``
            registers nothing.
        first_block: the pool is blocks ``[first_block, first_block + num_blocks)`` of the engine's
            cache, so that managers over disjoint ranges split one cache (the static-split baseline).
        max_retained_fraction: the most of the pool that freed blocks a request asked to keep
            (``free(..., retain_s)``, `kv_retention`) may hold at once (0: retention off).
        clock: monotonic seconds (retention deadlines).

    Raises:
        ValueError: ``num_blocks`` or ``block_size`` is < 1, or ``first_block`` < 0.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 first_block: int = 0, max_retained_fraction: float = 0.5,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if first_block < 0:
            raise ValueError(f"first_block must be >= 0, got {first_block}")
        self._num_blocks = num_blocks
        self._block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref_counts = [0] * (first_block + num_blocks)  # indexed by block id
        # Plain free blocks; dict for O(1) removal with insertion order (the first is reused first).
        self._free_plain: OrderedDict[int, None] = OrderedDict(
            (b, None) for b in range(first_block, first_block + num_blocks))
        # Cached blocks with ref count 0, least recently used first.
        self._evictable: OrderedDict[int, None] = OrderedDict()
        # Cached blocks with ref count 0 that their request asked to keep: taken after `_evictable`.
        self._retained = RetainedBlocks(int(num_blocks * max_retained_fraction) if enable_prefix_caching else 0)
        self._clock = clock
        self._hash_to_block: dict[int, int] = {}
        self._block_hash: dict[int, int] = {}
        self._block_key: dict[int, _BlockKey] = {}
        self._tables: dict[str, list[int]] = {}
        # Immutable copies of tables handed to plans (`allocate_table`), dropped when a table changes.
        self._snapshots: dict[str, tuple[int, ...]] = {}
        # Chain hashes of each request's full blocks computed so far (registered or not).
        self._req_hashes: dict[str, list[int]] = {}
        self.stats = PrefixCacheStats()

    # ----------------------------------------------------------------------------------- queries

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation may take now: plain free ones plus cached ones (retained ones included)."""
        return len(self._free_plain) + len(self._evictable) + len(self._retained)

    @property
    def num_cached_free_blocks(self) -> int:
        """Free blocks that still hold a reusable prefix (retained ones included)."""
        return len(self._evictable) + len(self._retained)

    @property
    def num_retained_blocks(self) -> int:
        """Free cached blocks kept for a continuation (`free(..., retain_s)`)."""
        return len(self._retained)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (cached free blocks count as free)."""
        return 1.0 - self.num_free_blocks / self._num_blocks

    @property
    def table_snapshots(self) -> Mapping[str, tuple[int, ...]]:
        """Request id -> the tuple `allocate_table` last returned, kept until the table changes.

        Read-only. A snapshot covering the positions a request needs is its current table, so the
        planner's loop reads this to skip a call for the decodes that stay inside their last block.
        """
        return self._snapshots

    def has_table(self, request_id: str) -> bool:
        return request_id in self._tables

    def block_table(self, request_id: str) -> list[int]:
        """A copy of the request's block table (empty if it holds no blocks)."""
        return list(self._tables.get(request_id, ()))

    def blocks_needed(self, request_id: str, num_total_tokens: int) -> int:
        """Extra blocks the request needs so that its table covers ``[0, num_total_tokens)``.

        Raises:
            ValueError: ``num_total_tokens`` is negative.
        """
        if num_total_tokens < 0:
            raise ValueError(f"num_total_tokens must be >= 0, got {num_total_tokens}")
        have = len(self._tables.get(request_id, ()))
        want = -(-num_total_tokens // self._block_size)
        return max(0, want - have)

    def can_allocate(self, request_id: str, num_total_tokens: int) -> bool:
        return self.blocks_needed(request_id, num_total_tokens) <= self.num_free_blocks

    # ------------------------------------------------------------------------ allocation / free

    def allocate_slots(self, request_id: str, num_total_tokens: int) -> bool:
        """Grow the request's table to cover positions ``[0, num_total_tokens)``.

        Returns:
            True on success; False, with nothing changed, when there are not enough free blocks
            (the scheduler's "does not fit" answer, never an exception).

        Raises:
            ValueError: ``num_total_tokens`` is negative.
        """
        table = self._tables.get(request_id)
        if table is not None and num_total_tokens <= len(table) * self._block_size:
            # Most calls are decodes inside the last block: nothing to take (a hot path).
            if num_total_tokens < 0:
                raise ValueError(f"num_total_tokens must be >= 0, got {num_total_tokens}")
            return True
        needed = self.blocks_needed(request_id, num_total_tokens)
        if needed > self.num_free_blocks:
            return False
        table = self._tables.setdefault(request_id, [])
        self._req_hashes.setdefault(request_id, [])
        self._snapshots.pop(request_id, None)
        for _ in range(needed):
            block = self._take_free_block()
            self._ref_counts[block] = 1
            table.append(block)
        return True

    def allocate_table(self, request_id: str, num_total_tokens: int) -> tuple[int, ...] | None:
        """`allocate_slots`, then the block table as an immutable tuple (None: nothing changed).

        One call per scheduled request in the planner's loop instead of two. The tuple is kept until
        the table changes, so a decode inside its last block (most calls) neither copies nor allocates.
        """
        snapshot = self._snapshots.get(request_id)
        if snapshot is not None and 0 <= num_total_tokens <= len(snapshot) * self._block_size:
            return snapshot
        if not self.allocate_slots(request_id, num_total_tokens):
            return None
        snapshot = self._snapshots[request_id] = tuple(self._tables[request_id])
        return snapshot

    def free(self, request_id: str, retain_s: float = 0.0) -> None:
        """Release the request's blocks; unknown ids are ignored (freeing twice is harmless).

        Blocks are released tail first, so among one request's cached blocks the later ones are
        evicted before the prefix that other requests are most likely to share (as in vLLM).
        With `retain_s` > 0 its cached blocks are retained for that long (`kv_retention`): taken by an
        allocation only once no other free block is left.
        """
        table = self._tables.pop(request_id, [])
        self._req_hashes.pop(request_id, None)
        self._snapshots.pop(request_id, None)
        now = self._clock()
        self._demote(self._retained.expired(now))
        retained: list[int] = []
        for block in reversed(table):
            self._ref_counts[block] -= 1
            if self._ref_counts[block] > 0:
                continue
            if block not in self._block_hash:
                self._free_plain[block] = None
            elif retain_s > 0:
                retained.append(block)
            else:
                self._evictable[block] = None
        for block in retained:  # tail first: over the bound its tail goes before its prefix
            self._demote(self._retained.add(block, now + retain_s))

    def _demote(self, blocks: list[int]) -> None:
        """Retained blocks past their deadline or the bound: ordinary cached blocks now, the first evicted
        (they were freed before every other cached block)."""
        for block in reversed(blocks):
            self._evictable[block] = None
            self._evictable.move_to_end(block, last=False)

    def _take_free_block(self) -> int:
        if self._free_plain:
            block, _ = self._free_plain.popitem(last=False)
            return block
        if self._evictable:
            block, _ = self._evictable.popitem(last=False)
        else:
            block = self._retained.pop_oldest()
        self._forget_hash(block)
        return block

    def _forget_hash(self, block: int) -> None:
        block_hash = self._block_hash.pop(block)
        del self._block_key[block]
        if self._hash_to_block.get(block_hash) == block:
            del self._hash_to_block[block_hash]

    # ---------------------------------------------------------------------------- prefix cache

    def match_prefix(self, request_id: str, token_ids: list[int], salt: int) -> int:
        """Share the cached full blocks that start ``token_ids`` into a new request's table.

        Walks full blocks from the start while the chained hash is cached and the stored
        ``(parent hash, tokens, salt)`` equal this request's (a hash alone is never trusted). At
        least one token is always left to compute, because the engine needs the logits of the last
        prompt position: if every block would match, the last matched block is dropped.

        Args:
            request_id: a request that holds no blocks yet.
            token_ids: the request's tokens (prompt, plus outputs kept across a preemption).
            salt: separates K/V that differ for the same tokens (e.g. the LoRA adapter).

        Returns:
            The number of leading tokens whose K/V are already cached (a multiple of block_size).

        Raises:
            ValueError: the request already holds blocks.
        """
        if request_id in self._tables:
            raise ValueError(f"match_prefix needs a request without blocks; {request_id!r} has "
                             f"{len(self._tables[request_id])}")
        self.stats.queries += 1
        self.stats.queried_tokens += len(token_ids)
        if not self.enable_prefix_caching:
            return 0
        matched, hashes = self._lookup_chain(token_ids, salt)
        for block in matched:
            if self._ref_counts[block] == 0:
                if block in self._retained:
                    self._retained.remove(block)
                else:
                    del self._evictable[block]
            self._ref_counts[block] += 1
        self._tables[request_id] = matched
        self._req_hashes[request_id] = hashes
        num_cached = len(matched) * self._block_size
        self.stats.hit_tokens += num_cached
        return num_cached

    def cached_prefix_blocks(self, prefix: PrefixHashes) -> int:
        """How many leading full blocks of `prefix` this cache holds (in use or free but cached).

        Read only (no reference taken, no stats): what a router asks of several engines before it
        picks one. Compares hashes only, unlike `match_prefix`: a collision would misroute a request,
        never alias its K/V.
        """
        if not self.enable_prefix_caching or prefix.block_size != self._block_size:
            return 0
        cached = self._hash_to_block
        count = 0
        while count < prefix.max_blocks and prefix[count] in cached:
            count += 1
        return count

    def _lookup_chain(self, token_ids: list[int], salt: int) -> tuple[list[int], list[int]]:
        # (len - 1) // block_size full blocks at most: the last token is always computed.
        max_blocks = max(0, len(token_ids) - 1) // self._block_size
        matched: list[int] = []
        hashes: list[int] = []
        parent = ROOT_HASH
        for index in range(max_blocks):
            tokens = tuple(token_ids[index * self._block_size:(index + 1) * self._block_size])
            block_hash = hash_block(parent, tokens, salt)
            block = self._hash_to_block.get(block_hash)
            if block is None or self._block_key[block] != _BlockKey(parent, tokens, salt):
                break
            matched.append(block)
            hashes.append(block_hash)
            parent = block_hash
        return matched, hashes

    def cache_full_blocks(self, request_id: str, token_ids: list[int], num_computed_tokens: int,
                          salt: int) -> None:
        """Register the request's blocks that became full (and computed) so later requests hit them.

        Call it after the engine computed positions ``[0, num_computed_tokens)``. A block whose
        content is already cached under another block id stays private to this request.

        Args:
            request_id: a request holding blocks.
            token_ids: its tokens; at least ``num_computed_tokens`` of them.
            num_computed_tokens: positions whose K/V are now in the cache.
            salt: the same salt the request used in ``match_prefix``.

        Raises:
            ValueError: unknown request, too few tokens, or more computed tokens than its table covers.
        """
        table = self._tables.get(request_id)
        if table is None:
            raise ValueError(f"cache_full_blocks: request {request_id!r} holds no blocks")
        if num_computed_tokens > len(token_ids) or num_computed_tokens > len(table) * self._block_size:
            raise ValueError(f"cache_full_blocks: {num_computed_tokens} computed tokens but "
                             f"{len(token_ids)} token ids and {len(table)} blocks for {request_id!r}")
        if not self.enable_prefix_caching:
            return
        hashes = self._req_hashes[request_id]
        num_full = num_computed_tokens // self._block_size
        for index in range(len(hashes), num_full):
            parent = hashes[-1] if hashes else ROOT_HASH
            tokens = tuple(token_ids[index * self._block_size:(index + 1) * self._block_size])
            block_hash = hash_block(parent, tokens, salt)
            hashes.append(block_hash)
            block = table[index]
            # A block already hashed was shared in by match_prefix; a taken hash means the same
            # content (or a colliding one) is cached elsewhere, and the first copy wins.
            if block in self._block_hash or block_hash in self._hash_to_block:
                continue
            self._hash_to_block[block_hash] = block
            self._block_hash[block] = block_hash
            self._block_key[block] = _BlockKey(parent, tokens, salt)
