"""The chained hashes of a prompt's full KV blocks: what the prefix cache (`kv_blocks`) keys blocks by and
what a router probes several engines' caches with (`PrefixHashes`)."""

from __future__ import annotations

# Parent hash of a sequence's first block (any fixed int works; it only seeds the chain).
ROOT_HASH = 0


def hash_block(parent_hash: int, block_tokens: tuple[int, ...], salt: int) -> int:
    """Chained hash of one full block: it depends on every token before it and on the salt.

    Python's hash of a tuple of ints is deterministic across processes (no hash randomisation for
    ints), so the same prompt gives the same chain everywhere.
    """
    return hash((parent_hash, block_tokens, salt))


class PrefixHashes:
    """The chained hashes of a prompt's full blocks, computed only as far as they are asked for.

    A router probes several engines' caches with one prompt (`KVBlockManager.cached_prefix_blocks`);
    most miss at the first block, so the chain is not hashed further than the longest hit.

    Args:
        token_ids: the prompt.
        salt: its prefix salt (`request_rules.prefix_salt`).
        block_size: tokens per block of the caches probed.
    """

    def __init__(self, token_ids: list[int], salt: int, block_size: int) -> None:
        self._tokens, self._salt, self._block_size = token_ids, salt, block_size
        # As `match_prefix`: the last token is always computed, so (len - 1) // block_size at most.
        self.max_blocks = max(0, len(token_ids) - 1) // block_size
        self._hashes: list[int] = []

    @property
    def block_size(self) -> int:
        return self._block_size

    def __getitem__(self, index: int) -> int:
        hashes, size = self._hashes, self._block_size
        while len(hashes) <= index:
            k = len(hashes)
            parent = hashes[-1] if hashes else ROOT_HASH
            hashes.append(hash_block(parent, tuple(self._tokens[k * size:(k + 1) * size]), self._salt))
        return hashes[index]
