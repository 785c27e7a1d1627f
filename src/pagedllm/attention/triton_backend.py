"""The generic backend's attention on a GPU: attention/triton_paged.py's one kernel for
decode, prefill chunks and mixed steps, behind the interface every attention backend has
(forward(query, kv_cache, meta) -> [T, heads * D]). An int8 KV cache (codes and scales) is
not read by that kernel yet: those layers take the torch path (BatchedBackend without
kernels)."""
from __future__ import annotations

import torch

from pagedllm.attention.batched import BatchedBackend
from pagedllm.attention.layer_cache import LayerKVCache
from pagedllm.attention.metadata import AttentionMetadata


class TritonBackend:
    name = "triton"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, *,
                 scale: float | None = None, softcap: float | None = None,
                 window: int | None = None):
        self.scale = head_dim ** -0.5 if scale is None else scale
        self.softcap, self.window = softcap, window
        self.torch_path = BatchedBackend(num_heads, num_kv_heads, head_dim, None, scale=scale,
                                         softcap=softcap, window=window)

    def forward(self, query: torch.Tensor, kv_cache: LayerKVCache,
                meta: AttentionMetadata) -> torch.Tensor:
        if kv_cache.key_scale is not None:
            return self.torch_path.forward(query, kv_cache, meta)
        from pagedllm.attention.triton_paged import paged_attention

        return paged_attention(query, kv_cache.key, kv_cache.value, meta, self.scale,
                               self.softcap, self.window).flatten(1)
