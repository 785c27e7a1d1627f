"""The sliding-window layers' own block pool (core/kv_cache/window.py), without a model:
blocks go back to the pool as they slide out of the window, so the pool's use stays flat
while a sequence grows; freed entries point at the null block; a prefix hit needs only the
blocks its first query reads; the sizing gives the full layers the memory this saves."""
import pytest

from pagedllm.model_config import ModelConfig
from pagedllm.core import sizing
from pagedllm.core.kv_cache import KVCacheManager, WindowBlocks
from pagedllm.core.request import Request, SamplingParams

BLOCK, WINDOW = 4, 16


def make_request(rid, tokens):
    return Request(rid, tokens, SamplingParams(max_tokens=1000), max_model_len=10_000)


def manager(full_blocks=200, window_blocks=40, caching=True):
    return KVCacheManager(full_blocks, BLOCK, caching,
                          WindowBlocks(window_blocks, BLOCK, WINDOW, caching))


def decode(kv, request, steps):
    """Grow the request one token a step, as the scheduler does; yield after each step."""
    for step in range(steps):
        assert kv.allocate_slots(request, request.num_tokens - request.num_computed_tokens)
        request.num_computed_tokens = request.num_tokens
        request.append_token(1000 + step)
        yield step


def test_a_growing_sequence_holds_a_flat_number_of_window_blocks():
    kv = manager()
    request = make_request("a", list(range(10)))
    most = sizing.window_request_blocks(WINDOW, BLOCK)  # 16 / 4 + 1
    held = []
    for _ in decode(kv, request, 150):
        held.append(kv.window.pool.num_used_blocks)
        assert kv.window.num_held("a") == held[-1] <= most
        # The full-attention layers keep every block.
        assert len(kv.block_table("a")) == -(-request.num_computed_tokens // BLOCK)
    assert max(held[20:]) == most and min(held[20:]) >= most - 1  # flat, not growing
    table = kv.window_block_table("a")
    last_query = request.num_computed_tokens - 1  # the last step's token
    first_seen = max(0, last_query - WINDOW + 1) // BLOCK
    assert table[:first_seen] == [kv.window.null_block_id] * first_seen
    assert kv.window.null_block_id not in table[first_seen:]
    kv.free(request)
    assert kv.window.pool.num_free_blocks == 40 and kv.num_free_blocks == 200


def test_a_prefill_chunk_gets_its_window_and_its_tokens():
    kv = manager()
    request = make_request("a", list(range(60)))
    assert kv.allocate_slots(request, 30)
    assert kv.window.num_held("a") == 8  # nothing computed yet: all of 0..29
    request.num_computed_tokens = 30
    assert kv.allocate_slots(request, 30)
    # The chunk's first query (30) reads from 15 on: blocks 3..14 are held, 0..2 went back.
    assert kv.window.num_held("a") == 12
    assert kv.window_block_table("a")[:3] == [kv.window.null_block_id] * 3


def test_a_step_is_refused_when_the_window_pool_is_short_and_nothing_changes():
    kv = manager(window_blocks=6)
    first, second = make_request("a", list(range(20))), make_request("b", list(range(100, 120)))
    assert kv.allocate_slots(first, 20)  # 5 of the 6 window blocks
    free_full = kv.num_free_blocks
    assert not kv.allocate_slots(second, 20)
    assert kv.num_free_blocks == free_full and kv.block_table("b") == ()
    assert kv.window_block_table("b") == []


def test_a_prefix_hit_needs_only_the_window_blocks_its_first_query_reads():
    kv = manager()
    prompt = list(range(40))
    first = make_request("a", prompt + [7])
    for _ in decode(kv, first, 1):
        pass
    # The first request's early window blocks slid out but stay cached (lazy eviction):
    second = make_request("b", prompt + [8])
    blocks, tokens = kv.get_computed_blocks(second)
    assert tokens == 40
    assert kv.allocate_slots(second, 1, blocks)
    assert kv.block_table("b")[:10] == kv.block_table("a")[:10]  # the full layers share all
    first_seen = (40 - WINDOW + 1) // BLOCK
    shared = kv.window_block_table("b")[first_seen:10]
    assert shared == kv.window_block_table("a")[first_seen:10]
    assert kv.window_block_table("b")[:first_seen] == [kv.window.null_block_id] * first_seen
    kv.free(first)
    kv.free(second)
    assert kv.window.pool.num_free_blocks == 40


def test_a_hit_is_cut_where_a_window_block_it_would_read_was_evicted():
    kv = manager(window_blocks=12)
    first = make_request("a", list(range(40)) + [7])
    assert kv.allocate_slots(first, 41)  # 11 window blocks, then 0..5 slide out
    first.num_computed_tokens = 41
    first.append_token(9)
    assert kv.allocate_slots(first, 1)
    kv.free(first)
    # Another request takes window blocks, evicting the cached ones it is handed first.
    other = make_request("x", list(range(500, 540)))
    assert kv.allocate_slots(other, 40)
    second = make_request("b", list(range(40)) + [8])
    blocks, tokens = kv.get_computed_blocks(second)
    assert tokens < 40  # the full layers still hold all 10 blocks; the window ones do not
    num_hit = tokens // BLOCK
    cached = [kv.window.pool.get_cached_block(h) for h in kv._block_hashes(second, num_hit)]
    first_seen = (tokens - WINDOW + 1) // BLOCK if tokens else 0
    assert all(b is not None for b in cached[max(0, first_seen):num_hit])


def _gemma_like(num_layers=6, sliding=(0, 1, 2, 3, 4), window=512, context=8192):
    return ModelConfig(architecture="gemma3_text", vocab_size=1000, hidden_size=256,
                       intermediate_size=512, num_layers=num_layers, num_heads=4,
                       num_kv_heads=1, head_dim=64, rms_norm_eps=1e-6, rope_theta=1e6,
                       max_position_embeddings=context, tie_word_embeddings=True,
                       sliding_window=window, sliding_layers=sliding)


def test_pool_sizes_give_the_full_layers_what_the_window_saves():
    config = _gemma_like()
    memory = 64 << 20
    plain = sizing.num_blocks_for_memory(memory, config, 2, 16)
    pools = sizing.pool_sizes(memory, config, 2, 16, "auto", 8, 8192, 512)
    assert pools.window_num_blocks == 8 * sizing.window_request_blocks(512, 16) + 512 // 16
    assert pools.num_blocks > 4 * plain  # 1 full layer of 6 takes most of the memory
    used = (pools.num_blocks * 1 + pools.window_num_blocks * 5) * sizing.kv_bytes_per_token(
        config, 2) // 6 * 16
    assert used <= memory
    # Where every layer slides (Mistral) or none does, one pool as before.
    for other in (_gemma_like(sliding=()), _gemma_like(window=None)):
        assert sizing.pool_sizes(memory, other, 2, 16, "auto", 8, 8192, 512) == \
            sizing.PoolSizes(sizing.num_blocks_for_memory(memory, other, 2, 16), None, None)


def test_pool_sizes_stay_positive_when_memory_is_tight():
    """A budget smaller than what the window pool would want for its requests: both pools
    get blocks, the full one at least as many, and together they fit the budget (this once
    gave the full pool a negative count)."""
    config = _gemma_like(window=4096)
    memory = 2 << 20
    plain = sizing.num_blocks_for_memory(memory, config, 2, 16)
    pools = sizing.pool_sizes(memory, config, 2, 16, "auto", 8192, 8192, 2048)
    assert 1 <= pools.window_num_blocks <= plain <= pools.num_blocks
    used = (pools.num_blocks * 1 + pools.window_num_blocks * 5) * sizing.kv_bytes_per_token(
        config, 2) // 6 * 16
    assert used <= memory


def test_a_request_costs_its_window_not_its_context_in_window_layers():
    config = _gemma_like()
    per_layer_token = sizing.kv_bytes_per_token(config, 2) // 6
    per_request = sizing.kv_bytes_per_request(config, 2, "auto", 8192, 16)
    assert per_request == per_layer_token * 16 * (8192 // 16 + 5 * (512 // 16 + 1))
    short = sizing.kv_bytes_per_request(config, 2, "auto", 100, 16)  # shorter than the window
    assert short == per_layer_token * 16 * 7 * 6


@pytest.mark.parametrize("window", [0, -3])
def test_a_window_must_be_positive(window):
    with pytest.raises(ValueError, match="window"):
        WindowBlocks(4, BLOCK, window)
