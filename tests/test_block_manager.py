"""Block manager: prefix matching over full computed blocks, reference counts, LRU reuse."""

from __future__ import annotations

from kserve.engine import block_manager
from kserve.engine.block_manager import BlockManager
from kserve.engine.sampling_params import SamplingParams
from kserve.engine.sequence import Sequence

BS = 4


def make_seq(tokens: list[int], sid: int) -> Sequence:
    return Sequence(sid, f"r{sid}", 0, tokens, SamplingParams(), sid)


def admit_and_compute(bm: BlockManager, seq: Sequence) -> list[int]:
    cached = bm.match_prefix(seq)
    new = seq.num_tokens - len(cached) * BS
    assert bm.can_allocate(seq, cached, new)
    bm.allocate(seq, cached, new)
    seq.num_computed_tokens = seq.num_tokens
    bm.register_computed(seq)
    return cached


def test_shared_prefix_is_reused_and_refcounted() -> None:
    bm = BlockManager(16, BS)
    a = make_seq(list(range(10)), 0)  # blocks: [0..3] [4..7] [8, 9]
    assert admit_and_compute(bm, a) == []
    b = make_seq(list(range(8)) + [50, 51, 52], 1)
    cached = admit_and_compute(bm, b)
    assert cached == a.block_table[:2]
    assert [bm.blocks[i].ref_count for i in cached] == [2, 2]
    assert bm.prefix_hit_tokens == 8 and bm.prefix_miss_tokens == 10 + 3
    bm.free(a)
    assert [bm.blocks[i].ref_count for i in cached] == [1, 1]
    bm.free(b)
    assert bm.num_free_blocks == 16


def test_last_token_is_never_served_from_cache() -> None:
    bm = BlockManager(16, BS)
    a = make_seq(list(range(8)), 0)
    admit_and_compute(bm, a)
    same = make_seq(list(range(8)), 1)
    assert bm.match_prefix(same) == a.block_table[:1]  # the second block holds the last token


def test_diverging_block_breaks_the_chain() -> None:
    bm = BlockManager(16, BS)
    admit_and_compute(bm, make_seq(list(range(12)) + [99], 0))
    other = make_seq([0, 1, 2, 3, 9, 9, 9, 9, 8, 9, 10, 11, 12], 1)  # block 3 equal, parent differs
    assert len(bm.match_prefix(other)) == 1


def test_freed_cached_blocks_are_reused_lru_and_evicted_when_needed() -> None:
    bm = BlockManager(6, BS)
    a = make_seq(list(range(9)), 0)  # 3 blocks, 2 full and cached
    admit_and_compute(bm, a)
    table = list(a.block_table)
    bm.free(a)
    assert bm.num_free_blocks == 6
    again = make_seq(list(range(9)), 1)
    assert admit_and_compute(bm, again) == table[:2]  # still cached after being freed
    bm.free(again)
    # a new unrelated sequence needs all 6 blocks: the cached ones get evicted
    big = make_seq(list(range(100, 124)), 2)
    assert admit_and_compute(bm, big) == []
    assert sorted(big.block_table) == list(range(6))
    bm.free(big)
    assert bm.match_prefix(make_seq(list(range(9)), 3)) == []


def test_uncomputed_blocks_are_not_matched() -> None:
    bm = BlockManager(16, BS)
    a = make_seq(list(range(12)), 0)
    bm.allocate(a, [], 12)  # allocated but the model has not run yet
    assert bm.match_prefix(make_seq(list(range(12)) + [1], 1)) == []
    a.num_computed_tokens = 8  # a chunk of 8 ran
    bm.register_computed(a)
    assert len(bm.match_prefix(make_seq(list(range(12)) + [1], 1))) == 2


def test_can_allocate_counts_cached_free_blocks() -> None:
    bm = BlockManager(3, BS)
    a = make_seq(list(range(9)), 0)
    admit_and_compute(bm, a)
    bm.free(a)
    b = make_seq(list(range(8)) + [70, 71, 72, 73, 74], 1)  # 2 cached + needs 2 more = 4 > 3
    cached = bm.match_prefix(b)
    assert len(cached) == 2
    assert not bm.can_allocate(b, cached, 5)
    assert bm.can_allocate(b, cached, 4)


def first_token_hash(parent, token_ids):
    """A deliberately weak chain hash: blocks collide whenever their first tokens are equal."""
    return token_ids[0]


def test_hash_collision_with_a_block_at_another_depth_is_not_reused(monkeypatch) -> None:
    monkeypatch.setattr(block_manager, "chain_hash", first_token_hash)
    bm = BlockManager(16, BS)
    a = make_seq([10, 11, 12, 13, 20, 21, 22, 23, 99], 0)
    admit_and_compute(bm, a)
    # B's first block has A's second block's tokens and hash, but not its prefix: its KV differs
    b = make_seq([20, 21, 22, 23, 5], 1)
    assert bm.match_prefix(b) == []
    assert bm.match_prefix(make_seq([10, 11, 12, 13, 20, 21, 22, 23, 7], 2)) == a.block_table[:2]


def test_collision_against_an_evicted_parent_is_not_reused(monkeypatch) -> None:
    monkeypatch.setattr(block_manager, "chain_hash", first_token_hash)
    bm = BlockManager(16, BS)
    a = make_seq([1, 2, 3, 4, 5, 6, 7, 8, 0], 0)
    admit_and_compute(bm, a)
    a0, a1 = a.block_table[:2]
    bm.free(a)
    bm.free_ids.move_to_end(a0, last=False)
    bm._take_free_block()  # evicts A's first block; its child a1 stays cached
    assert bm.blocks[a1].hash is not None
    # C's first block collides with the evicted one (same hash, other tokens) and takes its place
    c = make_seq([1, 9, 9, 9, 0], 1)
    admit_and_compute(bm, c)
    # B follows C's first block with A's second block's tokens: a1 must not be reused after it
    b = make_seq([1, 9, 9, 9, 5, 6, 7, 8, 0], 2)
    assert bm.match_prefix(b) == c.block_table[:1]
