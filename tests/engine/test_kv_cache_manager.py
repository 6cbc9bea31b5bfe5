"""KVCacheManager: block tables, prefix hits, fork and copy-on-write, free order."""

from __future__ import annotations

from quire.engine.block_pool import BlockPool
from quire.engine.kv_cache_manager import KVCacheManager

from engine_fakes import make_seq

BS = 4


def manager(num_blocks: int = 8, caching: bool = True) -> KVCacheManager:
    return KVCacheManager(BlockPool(num_blocks, caching), BS)


def refs(kv: KVCacheManager, seq) -> list[int]:
    return [kv.pool.blocks[i].ref_cnt for i in kv.block_ids(seq)]


def admit(kv, seq):
    """What the scheduler does for a waiting sequence: prefix hits, then the rest."""
    computed, num_computed = kv.get_computed_blocks(seq)
    copies = kv.allocate_slots(seq, seq.num_tokens - num_computed, computed)
    seq.num_computed_tokens = seq.num_tokens
    return copies, num_computed


def test_slots_grow_block_by_block_and_fail_without_side_effects():
    kv = manager(num_blocks=3)
    seq = make_seq("a", prompt_len=5)
    assert kv.allocate_slots(seq, 5) == [] and len(kv.block_ids(seq)) == 2
    seq.num_computed_tokens = 5
    assert kv.allocate_slots(seq, 3) == [] and len(kv.block_ids(seq)) == 2  # room in block 2
    seq.num_computed_tokens = 8
    before = (kv.block_ids(seq), kv.num_free_blocks)
    assert kv.allocate_slots(seq, 9) is None, "9 more tokens need 3 blocks, 1 is free"
    assert (kv.block_ids(seq), kv.num_free_blocks) == before, "a failed allocation changed state"
    assert kv.max_fitting_tokens(seq, 9) == 4


def test_prefix_hit_shares_full_blocks_and_leaves_the_last_token_to_compute():
    kv = manager()
    a, b = make_seq("a", 9), make_seq("b", 9)  # same tokens
    admit(kv, a)
    _, hit_tokens = admit(kv, b)
    assert hit_tokens == 8, "two full blocks are shared; the 9th token is computed again"
    assert kv.block_ids(a)[:2] == kv.block_ids(b)[:2] and refs(kv, b) == [2, 2, 1]
    c = make_seq("c", 8)
    assert kv.get_computed_blocks(c)[1] == 4, "8 tokens: the last is left to compute"


def test_a_hit_on_a_cached_free_block_counts_against_free_blocks():
    kv = manager(num_blocks=3)
    a = make_seq("a", 9)
    admit(kv, a)
    kv.free(a)
    assert kv.num_used_blocks == 0 and kv.num_cached_free_blocks == 2
    b = make_seq("b", 13)  # 2 hits (cached-free) + 2 new blocks: 4 > 3
    computed, _ = kv.get_computed_blocks(b)
    assert len(computed) == 2
    assert kv.allocate_slots(b, 5, computed) is None
    assert kv.num_cached_free_blocks == 2, "a failed admission evicted a cached block"


def test_caching_on_keeps_freed_prefixes_off_forgets_them():
    for caching, expected in ((True, 8), (False, 0)):
        kv = manager(caching=caching)
        a = make_seq("a", 9)
        admit(kv, a)
        kv.free(a)
        assert kv.get_computed_blocks(make_seq("b", 9))[1] == expected


def test_caching_off_still_shares_between_sequences_of_one_client_request():
    kv = manager(caching=False)
    a = make_seq("r#0", 9, client_request_id="r")
    admit(kv, a)
    sibling = make_seq("r#1", 9, client_request_id="r")
    stranger = make_seq("s", 9, client_request_id="s")
    assert kv.get_computed_blocks(sibling)[1] == 8
    assert kv.get_computed_blocks(stranger)[1] == 0, "caching off shared across clients"


def test_fork_shares_every_block_and_copy_on_write_copies_the_partial_one():
    kv = manager()
    parent, child = make_seq("p", 6), make_seq("c", 6)
    admit(kv, parent)
    kv.fork(parent, child)
    child.num_computed_tokens = 6
    assert kv.block_ids(child) == kv.block_ids(parent) and refs(kv, parent) == [2, 2]
    copies = kv.allocate_slots(parent, 1)
    assert len(copies) == 1 and copies[0][0] == kv.block_ids(child)[1]
    assert copies[0][1] == kv.block_ids(parent)[1] != kv.block_ids(child)[1]
    assert kv.allocate_slots(child, 1) == [], "the last holder of a block writes in place"
    assert refs(kv, parent) == [2, 1] and refs(kv, child) == [2, 1]


def test_blocks_to_grow_counts_one_copy_less_when_the_group_holds_the_block_alone():
    kv = manager()
    beams = [make_seq(f"b{i}", 6) for i in range(3)]
    admit(kv, beams[0])
    for b in beams[1:]:
        kv.fork(beams[0], b)
        b.num_computed_tokens = 6
    assert kv.num_blocks_to_grow(beams, [1, 1, 1]) == 2, "3 writers, 2 copies"
    assert kv.num_blocks_to_grow(beams[:2], [1, 1]) == 2, "a third holder outside: 2 copies"
    free = kv.num_free_blocks
    for b in beams:
        kv.allocate_slots(b, 1)
    assert free - kv.num_free_blocks == 2


def test_free_gives_the_tail_back_first_so_the_head_is_evicted_last():
    kv = manager(num_blocks=3)
    a = make_seq("a", 12)
    admit(kv, a)
    head, middle, tail = kv.block_ids(a)
    kv.free(a)
    b = make_seq("b", 4, first_token=500)  # no hit: takes the least recently freed block
    kv.allocate_slots(b, 4)
    assert kv.block_ids(b) == [tail], "the head of a prefix was evicted before its tail"
    assert kv.get_computed_blocks(make_seq("c", 9))[1] == 8  # head and middle survive


def test_a_failed_step_uncaches_the_blocks_it_registered():
    kv = manager()
    a = make_seq("a", 9)
    admit(kv, a)
    kv.step_failed()
    kv.free(a)
    assert kv.get_computed_blocks(make_seq("b", 9))[1] == 0, "garbage KV stayed cached"


def test_swap_in_adopts_fresh_blocks():
    kv = manager(num_blocks=2)
    a = make_seq("a", 5)
    assert kv.adopt_fresh_blocks(a, 3) is None
    assert len(kv.adopt_fresh_blocks(a, 2)) == 2 and kv.num_free_blocks == 0
    assert kv.num_slack_tokens([a]) == 8
