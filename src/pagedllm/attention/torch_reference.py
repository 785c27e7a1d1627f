"""Reference paged attention in plain torch: the oracle that faster backends are tested against.

Correct for any mix of prefill chunks and single decode tokens, with grouped-query attention.
It loops over sequences in Python, which is simple and slow.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedllm.attention.layer_cache import LayerKVCache, quantize_rows
from pagedllm.attention.metadata import AttentionMetadata


def write_kv(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
             value_cache: torch.Tensor, slot_mapping: torch.Tensor,
             key_scales: torch.Tensor | None = None, value_scales: torch.Tensor | None = None) -> None:
    """Store this step's K/V rows ([T, kv_heads, head_dim]) at their slots in the paged cache;
    an int8 cache (scales given) gets each row's codes and scale (layer_cache.quantize_rows)."""
    num_kv_heads, head_dim = key.shape[1], key.shape[2]
    for rows, cache, scales in ((key, key_cache, key_scales), (value, value_cache, value_scales)):
        if scales is not None:
            rows, row_scales = quantize_rows(rows)
            scales.view(-1, num_kv_heads).index_copy_(0, slot_mapping, row_scales)
        cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, rows.to(cache.dtype))


class TorchReferenceBackend:
    name = "torch-reference"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int):
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim ** -0.5

    def forward(self, query: torch.Tensor, kv_cache: LayerKVCache,
                meta: AttentionMetadata) -> torch.Tensor:
        """query [T, heads, D]; cache [num_blocks, block_size, kv_heads, D], already holding this
        step's K/V (written with write_kv). Returns [T, heads * D]."""
        output = torch.empty_like(query)
        for i in range(meta.num_seqs):
            start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
            seq_len = meta.seq_lens[i]
            num_queries = end - start
            blocks = meta.blocks_of(i)
            keys = kv_cache.keys(blocks).flatten(0, 1)[:seq_len].to(query.dtype)  # [L, kv_heads, D]
            values = kv_cache.values(blocks).flatten(0, 1)[:seq_len].to(query.dtype)
            # Query j sits at position seq_len - num_queries + j and sees keys up to it.
            query_pos = torch.arange(seq_len - num_queries, seq_len).unsqueeze(1)
            mask = torch.arange(seq_len).unsqueeze(0) <= query_pos
            out = F.scaled_dot_product_attention(
                query[start:end].transpose(0, 1),  # [heads, nq, D]
                keys.transpose(0, 1), values.transpose(0, 1),
                attn_mask=mask, scale=self.scale, enable_gqa=self.num_heads != self.num_kv_heads,
            )
            output[start:end] = out.transpose(0, 1)
        return output.flatten(1)
