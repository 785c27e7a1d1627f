"""Turns a SchedulerOutput into tensors, runs the model over the paged KV cache and samples.

Owns the KV tensors: per layer a LayerKVCache, key and value [num_blocks, block_size,
kv_heads, head_dim] (int8 codes and their scales with kv_cache_dtype "int8"). All per-step
metadata is built here once and passed down explicitly.
"""
from __future__ import annotations

import torch

from pagedllm.attention import AttentionMetadata, allocate_layer_caches
from pagedllm.config import ModelConfig
from pagedllm.core.request import TokenLogprob
from pagedllm.sampler import Sampler, SamplingRow
from pagedllm.core.scheduler import SchedulerOutput


class ModelRunner:
    def __init__(self, model, config: ModelConfig, num_blocks: int, block_size: int,
                 dtype: torch.dtype, kv_cache_dtype: str = "auto"):
        self.model = model
        self.config = config
        self.block_size = block_size
        self.num_blocks = num_blocks
        # Mapped lazily (resident as blocks are first written). Attention reads only slots
        # it has written (padding is masked and zeroed).
        self.kv_caches = allocate_layer_caches(config.num_layers, num_blocks, block_size,
                                               config.num_kv_heads, config.head_dim, dtype,
                                               kv_cache_dtype)
        self.sampler = Sampler()
        # Seeded requests' random streams, by request id: created at a request's first sampled
        # token, kept across preemption (so a seed gives the same tokens), dropped by forget().
        self.generators: dict[str, torch.Generator] = {}

    def generator_for(self, request) -> torch.Generator | None:
        seed = request.params.seed
        if seed is None:
            return None
        generator = self.generators.get(request.request_id)
        if generator is None:
            generator = self.generators[request.request_id] = torch.Generator().manual_seed(seed)
        return generator

    def forget(self, request_id: str) -> None:
        """The request finished or was aborted: its random stream goes."""
        self.generators.pop(request_id, None)

    def execute(self, out: SchedulerOutput) -> dict[str, tuple[int, TokenLogprob | None]]:
        """Run one step. Returns, for each request that samples this step, (token, logprob)."""
        if out.is_empty:
            return {}
        input_ids, positions, slot_mapping = [], [], []
        query_start_loc, seq_lens, block_tables = [0], [], []
        sample_indices, rows, sampled_ids = [], [], []
        bs = self.block_size
        for item in out.scheduled:
            request = item.request
            start = request.num_computed_tokens
            end = start + item.num_new_tokens
            table = item.block_table
            input_ids.extend(request.all_token_ids[start:end])
            positions.extend(range(start, end))
            slot_mapping.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            query_start_loc.append(query_start_loc[-1] + item.num_new_tokens)
            seq_lens.append(end)
            block_tables.append(table)
            if item.samples:
                sample_indices.append(query_start_loc[-1] - 1)
                rows.append(SamplingRow(request.params, request.prompt_token_ids,
                                        request.output_token_ids, self.generator_for(request)))
                sampled_ids.append(request.request_id)

        meta = AttentionMetadata.build(slot_mapping, query_start_loc, seq_lens, block_tables, bs)
        hidden = self.model(torch.tensor(input_ids, dtype=torch.long),
                            torch.tensor(positions, dtype=torch.long), self.kv_caches, meta)
        if not sample_indices:
            return {}
        logits = self.model.compute_logits(hidden[sample_indices])
        tokens, logprobs = self.sampler(logits, rows)
        return {rid: (tok, lp) for rid, tok, lp in zip(sampled_ids, tokens, logprobs)}
