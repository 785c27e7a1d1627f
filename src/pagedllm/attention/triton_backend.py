"""The generic backend's attention on a GPU: attention/triton_paged.py's kernels for
decode, prefill chunks and mixed steps, behind the interface every attention backend has
(forward(query, kv_cache, meta) -> [T, heads * D]), an int8 KV cache's codes and scales
too."""
from __future__ import annotations

import torch

from pagedllm.attention.layer_cache import LayerKVCache
from pagedllm.attention.metadata import AttentionMetadata


class TritonBackend:
    name = "triton"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, *,
                 scale: float | None = None, softcap: float | None = None,
                 window: int | None = None):
        self.scale = head_dim ** -0.5 if scale is None else scale
        self.softcap, self.window = softcap, window

    def forward(self, query: torch.Tensor, kv_cache: LayerKVCache,
                meta: AttentionMetadata) -> torch.Tensor:
        from pagedllm.attention.triton_paged import paged_attention

        return paged_attention(query, kv_cache.key, kv_cache.value, meta, self.scale,
                               self.softcap, self.window, key_scales=kv_cache.key_scale,
                               value_scales=kv_cache.value_scale).flatten(1)
