"""KV-cache sizing: bytes per token, blocks for a memory budget, the `auto` parallel setting.

Memory scales with parallel requests x context length; every figure the engine logs and the
`plan` command prints (tools/plan.py) comes from these functions.
"""
from __future__ import annotations

from dataclasses import dataclass

from pagedllm.model_config import ModelConfig

# `max_num_seqs="auto"` assumes requests use up to this many tokens on average when the
# context is longer; preemption covers the rare request that needs more.
AUTO_TYPICAL_REQUEST_TOKENS = 1024
AUTO_MAX_NUM_SEQS = 64
# On a GPU more requests at once cost little more a step than one (vLLM's default, 256).
GPU_AUTO_MAX_NUM_SEQS = 256


def auto_max_num_seqs_cap(device: str) -> int:
    return GPU_AUTO_MAX_NUM_SEQS if device == "cuda" else AUTO_MAX_NUM_SEQS
# With no budget given, the KV cache is sized for the model: room for this many requests at
# its full context, within this share of the memory available once the weights are loaded
# (the rest is the OS's and the activations'), and never below the small floor.
DEFAULT_FULL_CONTEXT_REQUESTS = 4
DEFAULT_KV_AVAILABLE_SHARE = 0.5
DEFAULT_KV_FLOOR_FRACTION, DEFAULT_KV_FLOOR_BYTES = 0.1, 512 << 20


ELEMENT_SIZES = {"float32": 4, "bfloat16": 2}  # bytes per element of each model dtype
SCALE_BYTES = 4  # an int8 cache's float32 scale per (token, layer, K or V, KV head)


def kv_bytes_per_token(config: ModelConfig, element_size: int, kv_cache_dtype: str = "auto") -> int:
    """2 (K and V) x layers x kv_heads x head_dim x bytes per element; with kv_cache_dtype
    "int8", 1 byte an element plus a scale per row (2 x layers x kv_heads x 4 bytes)."""
    if kv_cache_dtype == "int8":
        return (config.kv_bytes_per_token_per_element
                + 2 * config.num_layers * config.num_kv_heads * SCALE_BYTES)
    return config.kv_bytes_per_token_per_element * element_size


def available_memory_bytes() -> int:
    import psutil
    return int(psutil.virtual_memory().available)


def resolve_kv_memory(kv_cache_memory: int | float | None,
                      full_request_bytes: int = 0) -> int:
    """Bytes for the KV cache: an int is bytes, a float in (0, 1] a fraction of available
    memory, None the default: DEFAULT_FULL_CONTEXT_REQUESTS requests of `full_request_bytes`
    (one request at the model's full context), within DEFAULT_KV_AVAILABLE_SHARE of available
    memory, and at least a tenth of it up to 512 MiB."""
    if kv_cache_memory is None:
        return default_kv_memory(available_memory_bytes(), full_request_bytes)
    if isinstance(kv_cache_memory, float) and 0 < kv_cache_memory <= 1:
        return int(available_memory_bytes() * kv_cache_memory)
    if kv_cache_memory <= 0:
        raise ValueError(f"kv_cache_memory must be positive, got {kv_cache_memory}")
    return int(kv_cache_memory)


def gpu_kv_memory(free: int, total: int, utilization: float,
                  shared_full_request_bytes: int | None = None) -> int:
    """A GPU's KV pool as vLLM sizes it with --gpu-memory-utilization: this process may hold
    `utilization` of the card; what is in use already (the weights just loaded, other
    processes, a store's other models) comes off that share, and the rest is the pool. 0
    when nothing is left. shared_full_request_bytes: the card is shared with other models
    (a store): the pool is the default amount of that rest for requests of this size, as
    on the host (default_kv_memory), not all of it."""
    if not 0 < utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization}")
    left = max(0, int(total * utilization) - (total - free))
    if shared_full_request_bytes is None:
        return left
    return default_kv_memory(left, shared_full_request_bytes) if left else 0


def default_kv_memory(available: int, full_request_bytes: int) -> int:
    floor = min(int(available * DEFAULT_KV_FLOOR_FRACTION), DEFAULT_KV_FLOOR_BYTES)
    wanted = DEFAULT_FULL_CONTEXT_REQUESTS * full_request_bytes
    return max(floor, min(wanted, int(available * DEFAULT_KV_AVAILABLE_SHARE)))


def num_blocks_for_memory(memory_bytes: int, config: ModelConfig, element_size: int,
                          block_size: int, kv_cache_dtype: str = "auto") -> int:
    return memory_bytes // (kv_bytes_per_token(config, element_size, kv_cache_dtype) * block_size)


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def max_full_context_requests(num_blocks: int, block_size: int, context_len: int) -> int:
    """How many requests of context_len tokens fit in the pool at once."""
    return num_blocks // blocks_for_tokens(context_len, block_size)


def auto_max_num_seqs(num_blocks: int, block_size: int, max_model_len: int,
                      cap: int = AUTO_MAX_NUM_SEQS) -> int:
    typical = min(max_model_len, AUTO_TYPICAL_REQUEST_TOKENS)
    return max(1, min(cap, max_full_context_requests(num_blocks, block_size, typical)))


# -- sliding-window layers in their own pool (Gemma 2 and 3: core/kv_cache/window.py) --------

def keeps_window_pool(config: ModelConfig) -> bool:
    """Whether the model's sliding-window layers get blocks of their own: layers with a window
    next to layers without one. (Where every layer slides, as in Mistral, every layer keeps
    its blocks in the one pool: the window is applied, but nothing is given back early.)"""
    return config.sliding_window is not None and bool(config.sliding_layers)


def window_request_blocks(window: int, block_size: int) -> int:
    """The most blocks a decoding request holds in the window layers' pool: the window, and
    the block its next token starts."""
    return blocks_for_tokens(window, block_size) + 1


def window_pool_blocks(config: ModelConfig, block_size: int, max_num_seqs: int,
                       max_num_batched_tokens: int) -> int:
    """The window pool that never runs out first: every running request at its most, plus
    the blocks a step's prefill chunks add (they share the step's token budget)."""
    return (max_num_seqs * window_request_blocks(config.sliding_window, block_size)
            + blocks_for_tokens(max_num_batched_tokens, block_size))


def kv_bytes_per_request(config: ModelConfig, element_size: int, kv_cache_dtype: str,
                         context: int, block_size: int) -> int:
    """One request of `context` tokens, whole blocks: every layer's K/V for the context, but
    in a window pool only the window's blocks."""
    blocks = blocks_for_tokens(context, block_size)
    per_token = kv_bytes_per_token(config, element_size, kv_cache_dtype)
    if not keeps_window_pool(config):
        return blocks * block_size * per_token
    per_layer = per_token // config.num_layers
    window_layers = len(config.sliding_layers)
    window_blocks = min(blocks, window_request_blocks(config.sliding_window, block_size))
    return block_size * per_layer * ((config.num_layers - window_layers) * blocks
                                     + window_layers * window_blocks)


@dataclass(frozen=True)
class PoolSizes:
    num_blocks: int  # the full-attention layers' pool (every layer's, without a window pool)
    window_num_blocks: int | None  # the sliding-window layers' pool; None: no such pool
    max_num_seqs: int | None  # what the window pool was sized for (None: not limited by it)


def pool_sizes(memory_bytes: int, config: ModelConfig, element_size: int, block_size: int,
               kv_cache_dtype: str, max_num_seqs: int | str, max_model_len: int,
               max_num_batched_tokens: int) -> PoolSizes:
    """Blocks for a memory budget. With a window pool, that pool gets what max_num_seqs
    requests can hold (window_pool_blocks, at most num_blocks, which leaves the other pool at
    least as large: a request never holds more window blocks than full ones) and the full-attention layers the rest; an
    `auto` max_num_seqs is settled on the way, from the full pool as it grows."""
    num_blocks = num_blocks_for_memory(memory_bytes, config, element_size, block_size, kv_cache_dtype)
    if not keeps_window_pool(config) or num_blocks < 1:
        return PoolSizes(num_blocks, None, None)
    per_layer_block = kv_bytes_per_token(config, element_size, kv_cache_dtype) // config.num_layers * block_size
    window_layers = len(config.sliding_layers)
    full_layers = config.num_layers - window_layers
    full_blocks, window_blocks, seqs = num_blocks, num_blocks, 1
    for _ in range(4):  # settles in two or three rounds: more full blocks, more auto seqs
        seqs = (max_num_seqs if max_num_seqs != "auto"
                else auto_max_num_seqs(full_blocks, block_size, max_model_len))
        # At most num_blocks (every layer the same blocks): the full pool then keeps at least
        # as many, never a negative count when memory is tight.
        window_blocks = min(num_blocks, window_pool_blocks(config, block_size, seqs,
                                                           max_num_batched_tokens))
        full_blocks = ((memory_bytes - window_blocks * window_layers * per_layer_block)
                       // (full_layers * per_layer_block)) if full_layers else num_blocks
    return PoolSizes(full_blocks, window_blocks, seqs)


def lora_slot_bytes(config, max_loras: int, max_rank: int, element_size: int) -> int:
    """The LoRA slots' memory (lora/slots.py): per layer and fused projection of P parts, A
    [slots, P * rank, in] and B [slots, rank, out]; a mixture of experts' MLP has none."""
    h, i = config.hidden_size, config.intermediate_size
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    per_rank = (3 * h + q + 2 * kv) + (q + h)  # qkv_proj, o_proj
    if not config.num_experts:
        per_rank += (2 * h + 2 * i) + (i + h)  # gate_up_proj, down_proj
    return per_rank * max_rank * max_loras * config.num_layers * element_size
