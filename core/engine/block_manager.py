"""Paged KV cache bookkeeping: fixed-size blocks, reference counts, chain-hashed prefix reuse."""

import struct
from collections import OrderedDict

import xxhash

from .sequence import Sequence


def chain_hash(parent: int | None, tokens: list[int]) -> int:
    """Hash of a full block that also covers every block before it, so equal hashes mean equal prefixes."""
    h = xxhash.xxh64()
    if parent is not None:
        h.update(parent.to_bytes(8, "little"))
    # One pack call, not a to_bytes per token: a batched prefill hashes thousands of blocks (docs/architecture.md).
    h.update(struct.pack(f"<{len(tokens)}I", *tokens))
    return h.intdigest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True):
        self.num_blocks, self.block_size, self.prefix_caching = num_blocks, block_size, prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.block_tokens: list[list[int] | None] = [None] * num_blocks
        self.hash_to_block: dict[int, int] = {}
        # Free blocks in eviction order: cached-but-unused blocks stay reusable until they reach the front; blocks
        # that cache nothing go to the front. (Taking the least recently used one for every block would touch the
        # whole pool in turn: on the CPU, whose pool is allocated untouched, resident memory would then grow ~45 MiB
        # with each 1k-token request until it held the whole pool.)
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.prefix_hits = 0  # blocks served from the cache
        self.prefix_queries = 0  # full prompt blocks of admitted sequences

    @property
    def num_free(self) -> int:
        return len(self.free)

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """Extra blocks `seq` needs so that its first `num_tokens` tokens have slots."""
        return max(0, -(-num_tokens // self.block_size) - len(seq.block_table))

    def admit(self, seq: Sequence) -> bool:
        """Give a waiting sequence its cached prefix blocks. Returns False if even those don't fit."""
        assert not seq.block_table
        cached = self._cached_prefix(seq) if self.prefix_caching else []
        # The last prompt token is always recomputed: its logits start the output.
        num_computed = min(len(cached) * self.block_size, len(seq) - 1)
        # Cached blocks nobody holds sit in the free list: taking them shrinks it.
        free_after = self.num_free - sum(1 for b in cached if self.ref_counts[b] == 0)
        if -(-(num_computed + 1) // self.block_size) - len(cached) > free_after:
            return False
        for block in cached:
            self._take(block)
        seq.block_table = cached
        seq.num_computed = seq.num_cached_prefix = num_computed
        return True

    def count_prefix_lookup(self, seq: Sequence) -> None:
        """Count an admission's full prompt blocks and its cache hits, once it is really admitted: a blocked
        admission retried every step must not inflate the counts."""
        self.prefix_queries += len(seq) // self.block_size
        self.prefix_hits += -(-seq.num_cached_prefix // self.block_size)

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        blocks, parent = [], None
        for start in range(0, len(seq) - self.block_size + 1, self.block_size):
            tokens = seq.token_ids[start : start + self.block_size]
            parent = chain_hash(parent, tokens)
            block = self.hash_to_block.get(parent)
            if block is None or self.block_tokens[block] != tokens:
                break
            blocks.append(block)
        return blocks

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        return self.blocks_needed(seq, num_tokens) <= self.num_free

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        for _ in range(self.blocks_needed(seq, num_tokens)):
            block = next(iter(self.free))
            self._forget(block)
            self._take(block)
            seq.block_table.append(block)

    def commit_full_blocks(self, seq: Sequence) -> None:
        """Register blocks filled by computed tokens so later requests can reuse them."""
        if not self.prefix_caching:
            return
        # Hashed blocks are always a prefix of the table, so only the new tail is walked: a step on the hot
        # path touches the one block (if any) that just filled, not the whole context.
        full = seq.num_computed // self.block_size
        first = full
        while first > 0 and self.block_hash[seq.block_table[first - 1]] is None:
            first -= 1
        parent = self.block_hash[seq.block_table[first - 1]] if first else None
        for i in range(first, full):
            block = seq.block_table[i]
            tokens = seq.token_ids[i * self.block_size : (i + 1) * self.block_size]
            parent = chain_hash(parent, tokens)
            self.block_hash[block], self.block_tokens[block] = parent, tokens
            self.hash_to_block.setdefault(parent, block)

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Drop blocks past `num_tokens` (rejected speculative tokens)."""
        keep = -(-num_tokens // self.block_size)
        for block in seq.block_table[keep:]:
            self._release(block)
        del seq.block_table[keep:]

    def free_sequence(self, seq: Sequence) -> None:
        # Release in reverse so a prefix's tail is evicted before its head.
        for block in reversed(seq.block_table):
            self._release(block)
        seq.block_table = []

    def _take(self, block: int) -> None:
        if self.ref_counts[block] == 0:
            del self.free[block]
        self.ref_counts[block] += 1

    def _release(self, block: int) -> None:
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self.free[block] = None
            if self.block_hash[block] is None:  # nothing to keep for reuse: handed out first, while its pages are warm
                self.free.move_to_end(block, last=False)

    def _forget(self, block: int) -> None:
        h = self.block_hash[block]
        if h is not None and self.hash_to_block.get(h) == block:
            del self.hash_to_block[h]
        self.block_hash[block] = self.block_tokens[block] = None
