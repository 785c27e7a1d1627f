"""Paged attention without a Python loop over decode sequences.

All single-token (decode) sequences of a step are handled in one call: the C++ kernel in
pagedllm/kernels reads K/V straight from the blocks; without it, their block tables, padded
to the longest, gather K/V in one indexing op and a length mask hides the padding. Prefill
chunks (several queries) take one kernel call per sequence, each token attending over its
causal context; without the kernel, one SDPA call per sequence (fused causal kernel when
the chunk is the whole sequence). Where the AMX tiles are in use (prefill_sdpa), large chunks
take that SDPA call too: oneDNN multiplies on the tiles, faster than the kernel's AVX512-BF16
dot products on those cores. Per-step index
tensors are built once in AttentionMetadata, never per layer. The torch reference backend
is the oracle this one is tested against. Gemma's and Mistral's options (a query scale of
their own, soft-capped scores, a sliding window) go to the kernel too; without it, to the
plain-torch SoftcapBackend.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedllm.attention.layer_cache import LayerKVCache
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.softcap import SoftcapBackend

# The head sizes the kernels are built for (kernels/dtype.h); any group of query heads.
KERNEL_HEAD_DIMS = (64, 80, 96, 128, 256)
# With prefill_sdpa, a chunk goes to SDPA from this many scores (heads x queries x context):
# below it the gather and SDPA's set-up cost more than the kernel's whole product (the
# crossover measured between 2^17 and 2^19; BENCHMARKS.md, "Prefill attention on the tiles").
SDPA_MIN_SCORES = 1 << 18


class BatchedBackend:
    name = "batched"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, kernels=None,
                 *, scale: float | None = None, softcap: float | None = None,
                 window: int | None = None, prefill_sdpa: bool = False):
        """kernels: the backend's compiled C++ module (None: the torch path). prefill_sdpa:
        prefill chunks go to torch's fused SDPA even with the kernels (Backend.prefill_sdpa:
        where oneDNN multiplies on the AMX tiles)."""
        # The kernel is specialised for these shapes; others take the torch path.
        supported = head_dim in KERNEL_HEAD_DIMS
        self.kernel = kernels if supported else None
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.group = num_heads // num_kv_heads
        self.scale = head_dim ** -0.5 if scale is None else scale
        self.softcap = softcap or 0.0  # the kernels' "none"
        self.window = window or 0
        # Only plain attention: the kernel alone takes Gemma's and Mistral's options.
        self.prefill_sdpa = prefill_sdpa and not (scale is not None or softcap or window)
        self.fallback = None
        if self.kernel is None and (scale is not None or softcap or window):
            self.fallback = SoftcapBackend(num_heads, num_kv_heads, head_dim, scale=scale,
                                           softcap=softcap, window=window)

    def forward(self, query: torch.Tensor, kv_cache: LayerKVCache,
                meta: AttentionMetadata) -> torch.Tensor:
        """query [T, heads, D]; this step's K/V are already in the cache. Returns [T, heads * D]."""
        if self.fallback is not None:
            return self.fallback.forward(query, kv_cache, meta)
        batch = meta.decode_batch()
        if batch is not None and len(batch.rows) == query.shape[0]:
            return self._decode(query, kv_cache, batch).flatten(1)
        output = torch.empty_like(query)
        if batch is not None:
            output[batch.rows_tensor] = self._decode(query[batch.rows_tensor], kv_cache, batch)
        for i in meta.prefill_seq_indices():
            start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
            output[start:end] = self._prefill(query[start:end], kv_cache, meta, i)
        return output.flatten(1)

    def _decode(self, query, kv: LayerKVCache, batch) -> torch.Tensor:
        """query [S, heads, D] (one token per sequence) -> [S, heads, D]."""
        if self.kernel is not None:
            return self.kernel.paged_decode_attention(query, kv.key, kv.value, batch.block_tables,
                                                      batch.seq_lens, self.scale, kv.key_scale,
                                                      kv.value_scale, self.softcap, self.window)
        num_seqs = query.shape[0]
        # float32 math: CPU bf16 kernels are slow for these small, oddly shaped products.
        keys = kv.keys(batch.block_tables).flatten(1, 2).float()  # [S, L, kv_heads, D]
        # Padding slots hold whatever the memory held: zero them, since 0 * NaN is NaN.
        values = kv.values(batch.block_tables).flatten(1, 2).float()
        values.masked_fill_(batch.padding_mask.view(num_seqs, -1, 1, 1), 0.0)
        # Group query heads by their KV head: [S, kv_heads, group, D] x [S, kv_heads, D, L].
        q = query.view(num_seqs, self.num_kv_heads, self.group, self.head_dim).float()
        scores = torch.matmul(q, keys.permute(0, 2, 3, 1)) * self.scale
        scores.masked_fill_(batch.padding_mask, float("-inf"))  # [S, 1, 1, L]
        out = torch.matmul(scores.softmax(dim=-1), values.transpose(1, 2))  # [S, kv_heads, group, D]
        return out.view(num_seqs, self.num_heads, self.head_dim).to(query.dtype)

    def _sdpa_takes(self, num_queries: int, seq_len: int, kv: LayerKVCache) -> bool:
        return (self.prefill_sdpa and not kv.quantized
                and self.num_heads * num_queries * seq_len >= SDPA_MIN_SCORES)

    def _prefill(self, query, kv: LayerKVCache, meta, i) -> torch.Tensor:
        seq_len = meta.seq_lens[i]
        blocks = meta.blocks_of(i)
        if self.kernel is not None and not self._sdpa_takes(query.shape[0], seq_len, kv):
            # Each token over its own causal context, straight from the blocks: no K/V gather,
            # no expanded KV heads (4.6x SDPA at 450 tokens on an AMD AVX512-BF16 host,
            # benchmarks/attention_kernels.py).
            return self.kernel.paged_prefill_attention(query, kv.key, kv.value, blocks,
                                                       seq_len - query.shape[0], self.scale,
                                                       kv.key_scale, kv.value_scale,
                                                       self.softcap, self.window)
        keys = kv.keys(blocks).flatten(0, 1)[:seq_len].transpose(0, 1).to(query.dtype)  # [kv_heads, L, D]
        values = kv.values(blocks).flatten(0, 1)[:seq_len].transpose(0, 1).to(query.dtype)
        if self.group > 1:
            keys = keys.repeat_interleave(self.group, dim=0)
            values = values.repeat_interleave(self.group, dim=0)
        mask = meta.prefill_mask(i)
        # 4-D inputs with expanded KV heads take torch's fused CPU kernel; 3-D inputs or
        # enable_gqa fall back to the math path, 2.5x slower here.
        out = F.scaled_dot_product_attention(
            query.transpose(0, 1).unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0),
            attn_mask=mask, is_causal=mask is None, scale=self.scale)
        return out[0].transpose(0, 1)
