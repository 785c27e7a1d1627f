"""Paged attention with Gemma's and Mistral's options in plain torch: its own query scale,
soft-capped scores (tanh(s / cap) * cap) and a sliding window per layer. One sequence at a
time, like the reference backend it extends; correct, not fast. The C++ kernels take the same
options (BatchedBackend); this runs where they cannot (no compiler, a head size they lack)
and is the oracle they are tested against (tests/test_attention_shapes.py).
"""
from __future__ import annotations

import torch

from pagedllm.attention.layer_cache import LayerKVCache
from pagedllm.attention.metadata import AttentionMetadata


class SoftcapBackend:
    name = "softcap"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, *,
                 scale: float | None = None, softcap: float | None = None,
                 window: int | None = None):
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.group = num_heads // num_kv_heads
        self.scale = head_dim ** -0.5 if scale is None else scale
        self.softcap = softcap
        self.window = window  # a query sees this many keys at most, itself included

    def forward(self, query: torch.Tensor, kv_cache: LayerKVCache,
                meta: AttentionMetadata) -> torch.Tensor:
        """query [T, heads, D]; the cache already holds this step's K/V. Returns [T, heads*D]."""
        output = torch.empty_like(query)
        for i in range(meta.num_seqs):
            start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
            seq_len, num_queries = meta.seq_lens[i], end - start
            # From the first block the first query sees: with a window, the blocks before it
            # may already be back in the pool (their table entries point at a null block).
            first_block = 0
            if self.window is not None:
                first_block = max(0, seq_len - num_queries - self.window + 1) // meta.block_size
            first_key = first_block * meta.block_size
            blocks = meta.blocks_of(i)[first_block:]
            keys = kv_cache.keys(blocks).flatten(0, 1)[:seq_len - first_key].to(query.dtype)
            values = kv_cache.values(blocks).flatten(0, 1)[:seq_len - first_key].to(query.dtype)
            keys = keys.repeat_interleave(self.group, dim=1).transpose(0, 1)  # [heads, L, D]
            values = values.repeat_interleave(self.group, dim=1).transpose(0, 1)
            scores = query[start:end].transpose(0, 1) @ keys.transpose(1, 2) * self.scale
            if self.softcap is not None:
                scores = torch.tanh(scores / self.softcap) * self.softcap
            query_pos = torch.arange(seq_len - num_queries, seq_len,
                                     device=query.device).unsqueeze(1)
            key_pos = torch.arange(first_key, seq_len, device=query.device).unsqueeze(0)
            visible = key_pos <= query_pos
            if self.window is not None:
                visible &= key_pos > query_pos - self.window
            scores = scores.masked_fill(~visible, float("-inf"))
            weights = torch.softmax(scores.float(), dim=-1).to(query.dtype)
            output[start:end] = (weights @ values).transpose(0, 1)
        return output.flatten(1)
