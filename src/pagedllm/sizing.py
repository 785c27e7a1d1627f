"""KV-cache sizing: bytes per token, blocks for a memory budget, the `auto` parallel setting.

Memory scales with parallel requests x context length; every figure the engine logs and the
`plan` command prints comes from these functions.
"""
from __future__ import annotations

from pagedllm.config import ModelConfig

# `max_num_seqs="auto"` assumes requests use up to this many tokens on average when the
# context is longer; preemption covers the rare request that needs more.
AUTO_TYPICAL_REQUEST_TOKENS = 2048
AUTO_MAX_NUM_SEQS = 64
DEFAULT_KV_FRACTION = 0.1  # of available memory, when no budget is given
DEFAULT_KV_MAX_BYTES = 4 << 30


def kv_bytes_per_token(config: ModelConfig, element_size: int) -> int:
    """2 (K and V) x layers x kv_heads x head_dim x bytes per element."""
    return config.kv_bytes_per_token_per_element * element_size


def available_memory_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import os
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def resolve_kv_memory(kv_cache_memory: int | float | None) -> int:
    """Bytes for the KV cache: an int is bytes, a float in (0, 1] a fraction of available
    memory, None the default (a tenth of available memory, at most 4 GiB)."""
    if kv_cache_memory is None:
        return min(int(available_memory_bytes() * DEFAULT_KV_FRACTION), DEFAULT_KV_MAX_BYTES)
    if isinstance(kv_cache_memory, float) and 0 < kv_cache_memory <= 1:
        return int(available_memory_bytes() * kv_cache_memory)
    if kv_cache_memory <= 0:
        raise ValueError(f"kv_cache_memory must be positive, got {kv_cache_memory}")
    return int(kv_cache_memory)


def num_blocks_for_memory(memory_bytes: int, config: ModelConfig, element_size: int,
                          block_size: int) -> int:
    return memory_bytes // (kv_bytes_per_token(config, element_size) * block_size)


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def max_full_context_requests(num_blocks: int, block_size: int, context_len: int) -> int:
    """How many requests of context_len tokens fit in the pool at once."""
    return num_blocks // blocks_for_tokens(context_len, block_size)


def auto_max_num_seqs(num_blocks: int, block_size: int, max_model_len: int) -> int:
    typical = min(max_model_len, AUTO_TYPICAL_REQUEST_TOKENS)
    return max(1, min(AUTO_MAX_NUM_SEQS, max_full_context_requests(num_blocks, block_size, typical)))
