"""BlockManager: reference counts, eviction order, chain-hashed prefix reuse, truncate and free."""

from flashnext.core.engine import block_manager
from flashnext.core.engine.block_manager import BlockManager, chain_hash
from flashnext.core.engine.sequence import SamplingParams, Sequence

BS = 4


def seq_of(tokens) -> Sequence:
    return Sequence(list(tokens), SamplingParams())


def compute(blocks: BlockManager, seq: Sequence) -> Sequence:
    """What the engine does for a whole prompt: admit, give it slots, mark it computed, publish its full blocks."""
    assert blocks.admit(seq)
    blocks.grow(seq, len(seq))
    seq.num_computed = len(seq)
    blocks.commit_full_blocks(seq)
    return seq


def test_grow_allocates_ceil_blocks_and_free_returns_them():
    blocks = BlockManager(8, BS)
    seq = compute(blocks, seq_of(range(10)))  # 10 tokens -> 3 blocks
    assert len(seq.block_table) == 3 and blocks.num_free == 5
    assert all(blocks.ref_counts[b] == 1 for b in seq.block_table)
    assert blocks.blocks_needed(seq, 12) == 0 and blocks.blocks_needed(seq, 13) == 1
    blocks.free_sequence(seq)
    assert seq.block_table == [] and blocks.num_free == 8 and set(blocks.ref_counts) == {0}


def test_shared_prefix_counts_references():
    blocks = BlockManager(16, BS)
    a = compute(blocks, seq_of(range(10)))
    b = seq_of(list(range(8)) + [99, 98, 97])
    assert blocks.admit(b)
    assert b.block_table == a.block_table[:2]  # two full blocks shared, the partial third is not
    assert b.num_computed == b.num_cached_prefix == 8
    assert [blocks.ref_counts[x] for x in a.block_table] == [2, 2, 1]
    blocks.free_sequence(a)
    assert [blocks.ref_counts[x] for x in b.block_table] == [1, 1]
    assert blocks.num_free == 16 - 2
    blocks.free_sequence(b)
    assert blocks.num_free == 16 and set(blocks.ref_counts) == {0}


def test_prefix_hits_are_counted():
    blocks = BlockManager(16, BS)
    compute(blocks, seq_of(range(12)))
    queries = blocks.prefix_queries
    b = seq_of(list(range(8)) + [50, 51, 52, 53, 54])
    blocks.admit(b)
    assert blocks.prefix_hits == 0  # counted only once the scheduler really admits it
    blocks.count_prefix_lookup(b)
    assert blocks.prefix_hits == 2
    assert blocks.prefix_queries - queries == 3  # full prompt blocks


def test_admit_counts_cached_free_blocks_as_taken():
    blocks = BlockManager(2, BS)
    a = compute(blocks, seq_of(range(8)))
    blocks.free_sequence(a)
    # Both cached blocks are free; reusing them leaves no block for the 9th token.
    assert not blocks.admit(seq_of(list(range(8)) + [9]))
    assert blocks.num_free == 2
    assert blocks.admit(seq_of(range(8)))  # the last token fits in the cached blocks


def test_last_prompt_token_is_always_recomputed():
    blocks = BlockManager(16, BS)
    a = compute(blocks, seq_of(range(8)))
    blocks.free_sequence(a)
    b = seq_of(range(8))  # the whole prompt is cached: two full blocks
    assert blocks.admit(b)
    assert len(b.block_table) == 2
    assert b.num_computed == 7  # its logits start the output, so the last token runs again


def test_hash_is_chained_over_the_whole_prefix():
    blocks = BlockManager(16, BS)
    compute(blocks, seq_of([1, 2, 3, 4, 5, 6, 7, 8, 9]))
    # Block [5, 6, 7, 8] exists, but behind a different first block: no hit.
    b = seq_of([9, 9, 9, 9, 5, 6, 7, 8, 9])
    assert blocks.admit(b)
    assert b.block_table == [] and b.num_computed == 0
    assert chain_hash(None, [5, 6, 7, 8]) != chain_hash(chain_hash(None, [1, 2, 3, 4]), [5, 6, 7, 8])


def test_hit_requires_equal_tokens_even_when_hashes_collide(monkeypatch):
    # A hash that ignores the tokens makes every first block collide; the token check must refuse the match.
    monkeypatch.setattr(block_manager, "chain_hash", lambda parent, tokens: 12345 if parent is None else parent + 1)
    blocks = BlockManager(16, BS)
    compute(blocks, seq_of([1, 2, 3, 4, 5]))
    b = seq_of([7, 7, 7, 7, 5])
    assert blocks.admit(b)
    assert b.block_table == []
    c = seq_of([1, 2, 3, 4, 6])
    assert blocks.admit(c) and len(c.block_table) == 1  # equal tokens still hit


def test_freed_cached_blocks_stay_reusable_until_evicted():
    blocks = BlockManager(4, BS)
    a = compute(blocks, seq_of(range(9)))  # blocks for [0..3], [4..7], partial [8]
    head, middle, tail = a.block_table
    blocks.free_sequence(a)
    # Released tail first: the free list (eviction order) ends ... middle, head; the partial tail cached nothing,
    # so it went to the front, to be taken first.
    assert list(blocks.free)[-2:] == [middle, head] and list(blocks.free)[0] == tail
    b = compute(blocks, seq_of([100, 101]))  # needs one block: the tail, not the never-used one
    assert b.block_table == [tail]
    c = seq_of(range(9))
    assert blocks.admit(c) and c.block_table == [head, middle]  # still cached
    blocks.free_sequence(b)
    blocks.free_sequence(c)


def test_blocks_that_cache_nothing_are_taken_again_first():
    """Without prefix caching, a finished request's blocks serve the next one: the pool's other pages stay
    untouched (on the CPU they are not resident until written)."""
    blocks = BlockManager(16, BS, prefix_caching=False)
    a = compute(blocks, seq_of(range(9)))
    used = list(a.block_table)
    blocks.free_sequence(a)
    b = compute(blocks, seq_of(range(50, 59)))
    assert b.block_table == used


def test_eviction_takes_the_oldest_free_block_and_forgets_its_hash():
    blocks = BlockManager(3, BS)
    a = compute(blocks, seq_of(range(8)))  # two full cached blocks; the third block was never used
    head, tail = a.block_table
    blocks.free_sequence(a)
    (never_used,) = set(range(3)) - {head, tail}
    assert list(blocks.free) == [never_used, tail, head]
    b = seq_of([50, 51, 52, 53, 54, 55, 56, 57])
    assert blocks.admit(b)
    blocks.grow(b, 8)
    assert b.block_table == [never_used, tail]  # front of the free list first
    blocks.free_sequence(b)
    c = seq_of(range(9))
    assert blocks.admit(c)
    assert c.block_table == [head]  # the evicted tail no longer answers for its old hash


def test_truncate_drops_blocks_past_the_kept_tokens():
    blocks = BlockManager(8, BS)
    seq = seq_of(range(6))
    assert blocks.admit(seq)
    blocks.grow(seq, 13)  # 4 blocks, e.g. room for speculative tokens
    table = list(seq.block_table)
    blocks.truncate(seq, 6)
    assert seq.block_table == table[:2]
    assert [blocks.ref_counts[b] for b in table] == [1, 1, 0, 0]
    assert blocks.num_free == 6
    blocks.truncate(seq, 8)  # already exact: no change
    assert seq.block_table == table[:2]


def test_truncate_keeps_shared_blocks_for_other_owners():
    blocks = BlockManager(8, BS)
    a = compute(blocks, seq_of(range(8)))
    b = seq_of(list(range(8)) + [1])
    blocks.admit(b)
    blocks.truncate(b, 4)
    assert b.block_table == a.block_table[:1]
    assert [blocks.ref_counts[x] for x in a.block_table] == [2, 1]


def test_admit_fails_only_without_a_free_block():
    blocks = BlockManager(2, BS)
    a = compute(blocks, seq_of(range(8)))
    b = seq_of([40, 41])
    assert not blocks.admit(b)
    assert b.block_table == []
    blocks.free_sequence(a)
    assert blocks.admit(b)


def test_prefix_caching_off_never_hits():
    blocks = BlockManager(8, BS, prefix_caching=False)
    a = compute(blocks, seq_of(range(8)))
    blocks.free_sequence(a)
    b = seq_of(range(8))
    assert blocks.admit(b) and b.block_table == []
    assert blocks.hash_to_block == {}


def test_identical_blocks_computed_twice_share_one_cache_entry():
    blocks = BlockManager(8, BS)
    a, b = seq_of(range(5)), seq_of(range(5))
    for s in (a, b):  # both admitted before either published its blocks
        assert blocks.admit(s)
        blocks.grow(s, 5)
    for s in (a, b):
        s.num_computed = 5
        blocks.commit_full_blocks(s)
    h = chain_hash(None, [0, 1, 2, 3])
    assert blocks.hash_to_block[h] == a.block_table[0]
    blocks.free_sequence(a)
    blocks.free_sequence(b)
    assert blocks.num_free == 8


def test_chain_hash_covers_the_parent_then_each_token_as_4_little_endian_bytes():
    """The hashed bytes are fixed (parent as 8 bytes, each token as 4, little-endian), so a prefix hashes the same
    on any host and token ids past 16 bits keep their high bytes."""
    import xxhash

    tokens = [0, 1, 70_000, 151_935, 2**31 + 5]
    expected = xxhash.xxh64(b"".join(t.to_bytes(4, "little") for t in tokens)).intdigest()
    assert chain_hash(None, tokens) == expected
    parent = 2**63 + 11
    assert (
        chain_hash(parent, tokens)
        == xxhash.xxh64(parent.to_bytes(8, "little") + b"".join(t.to_bytes(4, "little") for t in tokens)).intdigest()
    )
