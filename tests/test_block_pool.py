"""Block pool and KV cache manager: pure Python, no model."""
import pytest

from pagedllm.core.kv_cache import BlockPool, FreeBlockQueue, KVBlock, KVCacheManager, hash_block_tokens
from pagedllm.core.request import Request, SamplingParams


def make_request(rid, tokens, salt=None):
    return Request(rid, tokens, SamplingParams(max_tokens=8), max_model_len=10_000, cache_salt=salt)


def test_free_queue_is_lru_and_removes_from_the_middle():
    blocks = [KVBlock(i) for i in range(5)]
    queue = FreeBlockQueue(blocks)
    queue.remove(blocks[2])
    assert [b.block_id for b in queue] == [0, 1, 3, 4]
    assert queue.popleft().block_id == 0
    queue.append(blocks[0])
    assert [b.block_id for b in queue] == [1, 3, 4, 0]
    assert len(queue) == 4
    with pytest.raises(ValueError):
        queue.remove(blocks[2])


def test_hash_chains_parent_tokens_and_salt():
    a = hash_block_tokens(None, [1, 2, 3])
    assert a == hash_block_tokens(None, [1, 2, 3])
    assert a != hash_block_tokens(None, [1, 2, 4])
    b = hash_block_tokens(a, [4, 5, 6])
    assert b != hash_block_tokens(hash_block_tokens(None, [9, 9, 9]), [4, 5, 6])
    assert hash_block_tokens(None, [1, 2, 3], "alice") != hash_block_tokens(None, [1, 2, 3], "bob")
    assert hash_block_tokens(None, [1, 2, 3], "alice") != a


def test_pool_allocate_free_reference_counts():
    pool = BlockPool(4)
    blocks = pool.allocate(3)
    assert pool.num_free_blocks == 1 and all(b.ref_cnt == 1 for b in blocks)
    pool.touch(blocks[:1])
    assert blocks[0].ref_cnt == 2
    pool.free(reversed(blocks))
    assert pool.num_free_blocks == 3 and blocks[0].ref_cnt == 1
    with pytest.raises(ValueError):
        pool.allocate(4)
    pool.free([blocks[0]])
    with pytest.raises(ValueError, match="freed more"):
        pool.free([blocks[0]])


def test_freed_cached_block_is_reused_until_evicted_lazily():
    pool = BlockPool(2)
    (block,) = pool.allocate(1)
    pool.cache_block(block, b"h1")
    pool.free([block])
    assert pool.get_cached_block(b"h1") is block  # still cached while free
    pool.touch([block])  # a hit takes it back off the free queue
    assert pool.num_free_blocks == 1 and block.ref_cnt == 1
    pool.free([block])
    pool.allocate(2)  # reuse for new content evicts the hash
    assert pool.get_cached_block(b"h1") is None and block.block_hash is None


def test_lru_evicts_least_recently_freed_first():
    pool = BlockPool(3)
    blocks = pool.allocate(3)
    for i, b in enumerate(blocks):
        pool.cache_block(b, bytes([i]))
    pool.free([blocks[1]])
    pool.free([blocks[0]])
    pool.free([blocks[2]])
    (reused,) = pool.allocate(1)
    assert reused is blocks[1]
    assert pool.get_cached_block(b"\x00") is blocks[0] and pool.get_cached_block(b"\x01") is None


def test_manager_tables_grow_on_demand():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    req = make_request("a", list(range(10)))
    assert kv.allocate_slots(req, 6)
    assert len(kv.block_table("a")) == 2  # nothing reserved beyond the scheduled tokens
    req.num_computed_tokens = 6
    assert kv.allocate_slots(req, 4)
    assert len(kv.block_table("a")) == 3
    assert kv.num_free_blocks == 7


def test_manager_refuses_without_changing_anything():
    kv = KVCacheManager(num_blocks=2, block_size=4)
    req = make_request("a", list(range(12)))
    assert not kv.allocate_slots(req, 12)
    assert kv.num_free_blocks == 2 and kv.block_table("a") == ()


def test_block_table_is_one_tuple_until_the_blocks_change():
    """The plan carries the manager's tuple and the model runner rewrites its row of the
    batch's tables only for a new one: the same tuple while no block changes, a new one,
    with the right ids, after every change (a new block, a trim, a free)."""
    kv = KVCacheManager(num_blocks=10, block_size=4)
    req = make_request("a", list(range(6)))
    assert kv.allocate_slots(req, 6)
    first = kv.block_table("a")
    assert first == tuple(b.block_id for b in kv.req_blocks["a"]) and len(first) == 2
    req.num_computed_tokens = 6
    assert kv.allocate_slots(req, 1)  # slot 7 of 8: the same blocks
    assert kv.block_table("a") is first
    req.num_computed_tokens = 8
    assert kv.allocate_slots(req, 3)  # a third block
    grown = kv.block_table("a")
    assert grown is not first and grown[:2] == first and len(grown) == 3
    req.num_computed_tokens = 6
    kv.trim(req)  # back to the blocks of 6 tokens
    assert kv.block_table("a") == first and kv.block_table("a") is not grown
    kv.free(req)
    assert kv.block_table("a") == () and "a" not in kv._tables
    assert kv.block_table("never-seen") == () and "never-seen" not in kv._tables


def test_prefix_hit_shares_blocks_and_never_covers_last_token():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    first = make_request("a", list(range(12)))
    assert kv.get_computed_blocks(first) == ([], 0)
    assert kv.allocate_slots(first, 12)
    # Same 12 tokens: 3 full blocks cached, but the hit is capped at 2 (last token must run).
    second = make_request("b", list(range(12)))
    blocks, num_tokens = kv.get_computed_blocks(second)
    assert num_tokens == 8 and tuple(b.block_id for b in blocks) == kv.block_table("a")[:2]
    assert kv.allocate_slots(second, 4, blocks)
    assert kv.block_table("b")[:2] == kv.block_table("a")[:2]
    assert [b.ref_cnt for b in kv.req_blocks["b"]] == [2, 2, 1]
    # A longer prompt sharing the prefix gets all three blocks.
    third = make_request("c", list(range(12)) + [99])
    assert kv.get_computed_blocks(third)[1] == 12
    kv.free(first)
    kv.free(second)
    assert kv.num_free_blocks == 10


def test_partial_blocks_are_not_cached_and_salt_isolates():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    a = make_request("a", list(range(6)), salt="alice")
    kv.allocate_slots(a, 6)
    assert kv.get_computed_blocks(make_request("x", list(range(6)), salt="alice"))[1] == 4
    assert kv.get_computed_blocks(make_request("y", list(range(6)), salt="bob"))[1] == 0
    assert kv.get_computed_blocks(make_request("z", list(range(9)), salt="alice"))[1] == 4


def test_caching_disabled_never_hits():
    kv = KVCacheManager(num_blocks=10, block_size=4, enable_caching=False)
    kv.allocate_slots(make_request("a", list(range(12))), 12)
    assert kv.get_computed_blocks(make_request("b", list(range(12)))) == ([], 0)


def test_free_releases_in_reverse_so_prefix_outlives_tail():
    kv = KVCacheManager(num_blocks=4, block_size=2)
    req = make_request("a", list(range(8)))
    kv.allocate_slots(req, 8)
    table = kv.block_table("a")
    kv.free(req)
    order = [b.block_id for b in kv.pool.free_queue]
    assert order == list(reversed(table))  # tail evicted first, prefix last


def test_uncached_blocks_are_reused_before_untouched_ones():
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    pool.cache_block(a, b"full")
    pool.free([b, a])  # b holds a partial block: no hash
    assert [blk.block_id for blk in pool.free_queue] == [b.block_id, 2, 3, a.block_id]
    assert pool.allocate(1)[0] is b
