"""Sizing an engine's KV pool from its config and the model (engine/factory.py): the bytes
it gets, the blocks they hold (and the sliding-window layers' own pool where the model keeps
one), and the scheduler's limits that follow: the served context and the parallel requests.
The arithmetic itself is core/sizing.py's, shared with `pagedllm plan`."""
from __future__ import annotations

import logging

import torch

from pagedllm.config import CacheConfig, EngineConfig, SchedulerConfig
from pagedllm.model_config import ModelConfig
from pagedllm.core import sizing

logger = logging.getLogger("pagedllm")


def size_kv(config: EngineConfig, model_config: ModelConfig, torch_dtype: torch.dtype,
            device: str = "cpu") -> tuple[int, CacheConfig, SchedulerConfig, int | None]:
    """The KV pool (bytes, blocks; the sliding-window layers' own pool where they keep one)
    and the scheduler's limits that follow from it."""
    block_size, kv_cache_dtype = config.block_size, config.kv_cache_dtype
    element_size = torch.tensor([], dtype=torch_dtype).element_size()
    longest = model_config.max_position_embeddings
    full_request = sizing.kv_bytes_per_request(model_config, element_size, kv_cache_dtype,
                                               config.max_model_len or longest, block_size)
    kv_memory_bytes = _kv_memory(config, full_request, device)
    num_blocks = sizing.num_blocks_for_memory(kv_memory_bytes, model_config, element_size,
                                              block_size, kv_cache_dtype)
    if num_blocks < 1:
        raise ValueError(f"kv_cache_memory of {kv_memory_bytes} bytes holds no block of "
                         f"{block_size} tokens")
    # Sliding-window layers next to full ones keep their own, smaller pool; the full layers
    # get the memory that saves (sizing.pool_sizes).
    pools = sizing.pool_sizes(
        kv_memory_bytes, model_config, element_size, block_size, kv_cache_dtype,
        config.max_num_seqs, min(config.max_model_len or longest, num_blocks * block_size),
        config.step_budget(device))
    capacity = pools.num_blocks * block_size
    max_model_len = _max_model_len(config, longest, capacity, kv_memory_bytes, full_request)
    max_num_seqs = config.max_num_seqs
    if max_num_seqs == "auto":
        max_num_seqs = sizing.auto_max_num_seqs(pools.num_blocks, block_size, max_model_len,
                                                sizing.auto_max_num_seqs_cap(device))
        if pools.max_num_seqs is not None:  # what the window pool was sized for
            max_num_seqs = min(max_num_seqs, pools.max_num_seqs)
    cache_config = CacheConfig(block_size, pools.num_blocks, config.enable_prefix_caching,
                               kv_cache_dtype)
    # A window pool is sized for steps of step_budget tokens (sizing.window_pool_blocks, as
    # `pagedllm plan` counts it): its models keep that bound in every step.
    alone = (config.step_budget(device) if pools.window_num_blocks is not None
             else config.prefill_alone_budget(device))
    scheduler_config = SchedulerConfig(max_num_seqs=max_num_seqs,
                                       max_num_batched_tokens=config.step_budget(device),
                                       max_model_len=max_model_len,
                                       prefill_alone_tokens=alone)
    return kv_memory_bytes, cache_config, scheduler_config, pools.window_num_blocks


def _kv_memory(config: EngineConfig, full_request: int, device: str) -> int:
    """--kv-cache-memory, resolved; on a GPU without it, what --gpu-memory-utilization
    leaves once the weights are loaded (sizing.gpu_kv_memory)."""
    if device == "cuda" and config.kv_cache_memory is None:
        free, total = torch.cuda.mem_get_info()
        return sizing.gpu_kv_memory(free, total, config.gpu_memory_utilization,
                                    full_request if config.shares_device else None)
    return sizing.resolve_kv_memory(config.kv_cache_memory, full_request)


def _max_model_len(config: EngineConfig, longest: int, capacity: int, kv_memory_bytes: int,
                   full_request: int) -> int:
    """--max-model-len, checked against the pool; without it the model's context, or what
    the pool holds when that is less (said: a bigger model silently got a short context)."""
    max_model_len = config.max_model_len
    if max_model_len is None:
        max_model_len = min(longest, capacity)
        if max_model_len < longest:
            logger.warning(
                "the KV cache (%d MiB) holds %d tokens, less than the model's context of %d: "
                "serving up to %d; --kv-cache-memory %d MiB would hold one full-context "
                "request (`pagedllm plan` sizes more), or set --max-model-len",
                kv_memory_bytes >> 20, capacity, longest, max_model_len,
                -(-full_request >> 20))
    if not 1 <= max_model_len <= longest:
        raise ValueError(f"max_model_len must be 1-{longest}, got {max_model_len}")
    if max_model_len > capacity:
        raise ValueError(f"max_model_len {max_model_len} exceeds the KV cache capacity of "
                         f"{capacity} tokens; raise kv_cache_memory or lower max_model_len")
    return max_model_len
