"""The model runner's CUDA graphs, made and captured at start: decode steps by batch size
(cuda_graphs.py) and, unless a mixture of experts routes its tokens on the host, steps with
prefill chunks by token count (mixed_graphs.py), in one memory pool; the sizes, capture time
and memory are logged."""
from __future__ import annotations

import logging
import time

import torch

from pagedllm.model_config import ModelConfig

logger = logging.getLogger("pagedllm")


def _reserved(device: str) -> int:
    """Bytes the device's caching allocator holds (0 off a GPU): a capture's memory."""
    return torch.cuda.memory_reserved(device) if device.startswith("cuda") else 0


def capture_step_graphs(model, kv_caches, config: ModelConfig, dtype: torch.dtype,
                        block_size: int, num_blocks: int, window_num_blocks: int | None,
                        device: str, graph_batch: int, max_model_len: int | None,
                        graph_tokens: int | None, graph_sequences: int | None):
    """(DecodeGraphs, MixedGraphs or None), captured. The scratch blocks past each pool's
    last (num_blocks; the window pool's past its null block) take the padding rows."""
    from pagedllm.attention.triton_paged import tile_shape
    from pagedllm.engine.cuda_graphs import DecodeGraphs
    from pagedllm.engine.mixed_graphs import MixedGraphs

    started, reserved = time.monotonic(), _reserved(device)
    width = -(-(max_model_len or config.max_position_embeddings) // block_size) + 1
    window_scratch = None if window_num_blocks is None else window_num_blocks + 1
    decode = DecodeGraphs(model, kv_caches, graph_batch, width, block_size,
                          scratch_block=num_blocks, device=device,
                          window_scratch_block=window_scratch)
    decode.capture()
    mixed = None
    if graph_tokens:
        tokens = tile_shape(config.num_heads // config.num_kv_heads, config.head_dim, dtype,
                            decode=False).tokens
        mixed = MixedGraphs(model, kv_caches, graph_tokens, graph_sequences or graph_batch,
                            width, block_size, num_blocks, tokens, device, window_scratch,
                            pool=decode.pool)
        mixed.capture()
    logger.info("CUDA graphs: decode steps of %s rows, steps with prefill chunks of %s tokens, "
                "captured in %.1f s, %d MiB", decode.sizes, mixed.sizes if mixed else "no",
                time.monotonic() - started, (_reserved(device) - reserved) >> 20)
    return decode, mixed
