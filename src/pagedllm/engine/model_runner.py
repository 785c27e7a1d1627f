"""Turns a SchedulerOutput (plain records) into tensors, runs the model over the paged KV cache and samples.

Owns the KV tensors: per layer a LayerKVCache, key and value [num_blocks, block_size,
kv_heads, head_dim] (int8 codes and their scales with kv_cache_dtype "int8"). All per-step
metadata is built here once and passed down explicitly.
"""
from __future__ import annotations

import torch

from pagedllm.attention import AttentionMetadata, allocate_layer_caches
from pagedllm.config import ModelConfig
from pagedllm.core.request import SamplingParams
from pagedllm.core.step_records import RunnerOutput, SampledToken, SchedulerOutput
from pagedllm.engine.sampler import Sampler, SamplingRow


class ModelRunner:
    def __init__(self, model, config: ModelConfig, num_blocks: int, block_size: int,
                 dtype: torch.dtype, kv_cache_dtype: str = "auto",
                 window_num_blocks: int | None = None):
        """window_num_blocks: the sliding-window layers' own pool (KVCacheManager.window),
        where the model keeps them apart; those layers' tensors get one block more, the
        zeroed null block that freed table entries point at."""
        self.model = model
        self.config = config
        self.block_size = block_size
        self.num_blocks = num_blocks
        # Mapped lazily (resident as blocks are first written). Attention reads only slots
        # it has written (padding is masked and zeroed).
        self.kv_caches = allocate_layer_caches(config.num_layers, num_blocks, block_size,
                                               config.num_kv_heads, config.head_dim, dtype,
                                               kv_cache_dtype)
        if window_num_blocks is not None:
            window_caches = allocate_layer_caches(
                len(config.sliding_layers), window_num_blocks + 1, block_size,
                config.num_kv_heads, config.head_dim, dtype, kv_cache_dtype)
            for layer, cache in zip(config.sliding_layers, window_caches):
                for tensor in cache:
                    if tensor is not None:
                        tensor[window_num_blocks].zero_()
                self.kv_caches[layer] = cache
        self.sampler = Sampler()
        # What sampling needs of each request, by request id: registered when the engine
        # accepts it, its output grown by the tokens sampled here, dropped by forget(). A
        # seeded request's random stream is made at its first sample and kept across
        # preemption, so a seed gives the same tokens.
        self.sequences: dict[str, SamplingRow] = {}
        # The fault-injection seam (engine/faults.py): called with (request id, SamplingRow)
        # before sampling; raising fails that request. None unless a test asks.
        self.fault_injector = None

    def add_request(self, request_id: str, params: SamplingParams, prompt_token_ids: list[int],
                    grammar=None) -> None:
        """grammar: the request's GrammarMatcher (structured output), made off this thread."""
        generator = None if params.seed is None else torch.Generator().manual_seed(params.seed)
        self.sequences[request_id] = SamplingRow(params, list(prompt_token_ids), [], generator,
                                                 grammar)

    @property
    def generators(self) -> dict[str, torch.Generator]:
        """Seeded requests' random streams, by request id."""
        return {rid: row.generator for rid, row in self.sequences.items()
                if row.generator is not None}

    def forget(self, request_id: str) -> None:
        """The request finished or was aborted: its sampling state goes."""
        self.sequences.pop(request_id, None)

    def execute(self, plan: SchedulerOutput) -> RunnerOutput:
        """Run one step of the plan; sample for the requests whose plan says so."""
        if plan.is_empty:
            return RunnerOutput()
        input_ids, positions, slot_mapping = [], [], []
        query_start_loc, seq_lens, block_tables = [0], [], []
        window_slots, window_tables = [], []
        sample_indices, sampled_ids = [], []
        bs = self.block_size
        for item in plan.scheduled:
            start, end, table = item.start, item.start + item.num_new_tokens, item.block_table
            input_ids.extend(item.token_ids)
            positions.extend(range(start, end))
            slot_mapping.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            if item.window_block_table is not None:
                window = item.window_block_table
                window_slots.extend(window[p // bs] * bs + p % bs for p in range(start, end))
                window_tables.append(list(window))
            query_start_loc.append(query_start_loc[-1] + item.num_new_tokens)
            seq_lens.append(end)
            block_tables.append(list(table))
            if item.samples:
                sample_indices.append(query_start_loc[-1] - 1)
                sampled_ids.append(item.request_id)

        meta = AttentionMetadata.build(slot_mapping, query_start_loc, seq_lens, block_tables, bs)
        if window_tables:
            meta.window = AttentionMetadata.build(window_slots, query_start_loc, seq_lens,
                                                  window_tables, bs)
        hidden = self.model(torch.tensor(input_ids, dtype=torch.long),
                            torch.tensor(positions, dtype=torch.long), self.kv_caches, meta)
        if not sample_indices:
            return RunnerOutput()
        logits = self.model.compute_logits(hidden[sample_indices])
        return self._sample(logits, sampled_ids)

    def _sample(self, logits: torch.Tensor, request_ids: list[str]) -> RunnerOutput:
        """Sample the batch at once; if that fails, row by row, so that only the rows that
        fail alone fail (the others get the tokens the batch would have given them)."""
        rows = [self.sequences[rid] for rid in request_ids]
        result = RunnerOutput()
        try:
            batches = [(request_ids, rows, *self._sample_rows(logits, request_ids, rows))]
        except Exception:  # noqa: BLE001 - isolate the row below
            batches = []
            for i, (rid, row) in enumerate(zip(request_ids, rows)):
                try:
                    batches.append(([rid], [row], *self._sample_rows(logits[i:i + 1], [rid], [row])))
                except Exception as exc:  # noqa: BLE001 - fails this request only
                    result.failed[rid] = f"sampling failed: {type(exc).__name__}: {exc}"
        for ids, batch_rows, tokens, logprobs in batches:
            for rid, row, token, logprob in zip(ids, batch_rows, tokens, logprobs):
                if row.grammar is not None and row.grammar.failed:
                    # The library gave up (a limit, or a state it cannot go on from): an
                    # error for this request, never a "stop" the grammar does not accept.
                    result.failed[rid] = f"structured output failed: {row.grammar.error}"
                    continue
                try:
                    if row.grammar is not None:
                        row.grammar.accept(token)
                except Exception as exc:  # noqa: BLE001 - fails this request only
                    result.failed[rid] = f"grammar failed: {type(exc).__name__}: {exc}"
                    continue
                row.output_token_ids.append(token)
                result.sampled[rid] = SampledToken(token, logprob)
        return result

    def _sample_rows(self, logits: torch.Tensor, request_ids: list[str], rows: list[SamplingRow]):
        if self.fault_injector is not None:
            for rid, row in zip(request_ids, rows):
                self.fault_injector(rid, row)
        return self.sampler(logits, rows)
