"""Turns a SchedulerOutput (plain records) into tensors, runs the model over the paged KV cache and samples.

Owns the KV tensors: per layer a LayerKVCache, key and value [num_blocks, block_size,
kv_heads, head_dim] (int8 codes and their scales with kv_cache_dtype "int8"). All per-step
metadata is built here once and passed down explicitly.
"""
from __future__ import annotations

import torch

from pagedllm.attention import AttentionMetadata, allocate_layer_caches
from pagedllm.backends.host_values import to_device
from pagedllm.model_config import ModelConfig
from pagedllm.core.request import SamplingParams
from pagedllm.core.step_records import RunnerOutput, SchedulerOutput
from pagedllm.engine.block_table_rows import BlockTableRows
from pagedllm.engine.cuda_graphs import DecodeRow
from pagedllm.engine.mixed_graphs import MixedStep
from pagedllm.engine.launched_step import LaunchedStep, SampledRows
from pagedllm.engine.sampler import Sampler, SamplingRow, compute_logprobs
from pagedllm.engine.step_inputs import StepInputs, prepare_inputs
from pagedllm.engine.verify import accepted_tokens, verification_rows


class ModelRunner:
    def __init__(self, model, config: ModelConfig, num_blocks: int, block_size: int,
                 dtype: torch.dtype, kv_cache_dtype: str = "auto",
                 window_num_blocks: int | None = None, device: str = "cpu",
                 graph_batch: int | None = None, max_model_len: int | None = None,
                 graph_tokens: int | None = None, graph_sequences: int | None = None):
        """window_num_blocks: the sliding-window layers' own pool (KVCacheManager.window),
        where the model keeps them apart; those layers' tensors get one block more, the
        zeroed null block that freed table entries point at. device: where the model and
        its KV cache live (the backend's); logits come back to the host for sampling.
        graph_batch: capture decode steps of up to this many requests as CUDA graphs
        (engine/cuda_graphs.py; the cache gets one scratch block more, for padding rows).
        graph_tokens: with graph_batch, steps with prefill chunks of up to this many tokens
        and graph_sequences sequences as graphs too (engine/mixed_graphs.py)."""
        self.model = model
        self.config = config
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.device = device
        graphs = graph_batch is not None
        # Mapped lazily (resident as blocks are first written). Attention reads only slots
        # it has written (padding is masked and zeroed).
        self.kv_caches = allocate_layer_caches(config.num_layers, num_blocks + int(graphs),
                                               block_size, config.num_kv_heads,
                                               config.head_dim, dtype, kv_cache_dtype, device)
        if window_num_blocks is not None:
            # (+1: the null block; +1 more with graphs: their padding rows' scratch block)
            window_caches = allocate_layer_caches(
                len(config.sliding_layers), window_num_blocks + 1 + int(graphs), block_size,
                config.num_kv_heads, config.head_dim, dtype, kv_cache_dtype, device)
            for layer, cache in zip(config.sliding_layers, window_caches):
                for tensor in cache:
                    if tensor is not None:
                        tensor[window_num_blocks].zero_()
                self.kv_caches[layer] = cache
        self.sampler = Sampler()
        # The running requests' block tables, kept across steps (each group's own).
        self.table_rows = BlockTableRows()
        self.window_table_rows = BlockTableRows()
        # What sampling needs of each request, by request id: registered when the engine
        # accepts it, its output grown by the tokens sampled here, dropped by forget(). A
        # seeded request's random stream is made at its first sample and kept across
        # preemption, so a seed gives the same tokens.
        self.sequences: dict[str, SamplingRow] = {}
        # The fault-injection seam (engine/faults.py): called with (request id, SamplingRow)
        # before sampling; raising fails that request. None unless a test asks.
        self.fault_injector = None
        # The model's LoRA slots (lora/slots.py) when adapters are served, and each running
        # request's adapter by request id (its weights go into its slot before its steps).
        self.lora = None
        self.adapters: dict[str, object] = {}
        self.graphs = self.mixed_graphs = None
        if graphs:
            from pagedllm.engine.step_graphs import capture_step_graphs

            self.graphs, self.mixed_graphs = capture_step_graphs(
                model, self.kv_caches, config, dtype, block_size, num_blocks, window_num_blocks,
                device, graph_batch, max_model_len, graph_tokens, graph_sequences)

    def add_request(self, request_id: str, params: SamplingParams, prompt_token_ids: list[int],
                    grammar=None, adapter=None) -> None:
        """grammar: the request's GrammarMatcher (structured output), made off this thread;
        adapter: its LoRAAdapter (lora/adapter.py), None for the base model."""
        if adapter is not None:
            self.adapters[request_id] = adapter
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
        self.adapters.pop(request_id, None)
        self.table_rows.forget(request_id)
        self.window_table_rows.forget(request_id)

    def execute(self, plan: SchedulerOutput) -> RunnerOutput:
        """Run one step of the plan and sample for the requests whose plan says so: launch,
        sample and collect at once (overlapped steps call them apart, engine/engine.py)."""
        step = self.launch(plan)
        self.sample(step)
        return self.collect(step)

    def launch(self, plan: SchedulerOutput, previous: LaunchedStep | None = None) -> LaunchedStep:
        """Make the step's model call without waiting for its logits (on a GPU its kernels
        are queued; on a CPU it runs here). A PLACEHOLDER token is the one its request
        sampled in `previous`, taken from there where it is (engine/launched_step.py).

        A request that verifies proposals enters as single-token queries (step_inputs.py):
        the step is then a decode step to the model (its fused decode path), so every
        position's logits are bit-identical to decoding the tokens one at a time, and the
        tokens kept are the ones decoding without proposals gives (engine/verify.py)."""
        step = LaunchedStep(plan)
        if plan.is_empty:
            return step
        try:
            step.logits = self._forward(plan, previous, step)
        except Exception as exc:  # noqa: BLE001 - every request of this step fails
            step.error = f"the model step failed: {type(exc).__name__}: {exc}"
        return step

    def _forward(self, plan: SchedulerOutput, previous: LaunchedStep | None,
                 step: LaunchedStep) -> torch.Tensor | None:
        """The step's inputs and its model call; the sampled rows' logits (on a GPU [rows,
        vocab] stays there; grammar masks and seeded draws travel in), None if none samples."""
        inputs = prepare_inputs(plan, self.block_size, self.table_rows, self.window_table_rows,
                                step)
        pending = None
        if inputs.pending_at:  # sampled by `previous`: filled in on the device
            pending = (to_device(inputs.pending_at, torch.long, self.device),
                       previous.tokens_for(inputs.pending_of, self.device))
        if self.lora is not None:
            self._set_lora_batch(plan)
        hidden = self._run_model(inputs, pending, len(plan.scheduled))
        return self._logits(hidden, inputs.sample_indices)

    def _run_model(self, inputs: StepInputs, pending, num_requests: int) -> torch.Tensor:
        """The hidden states, by the fastest path that applies: a captured decode graph, a
        captured mixed-step graph (neither with adapters in the batch), else eagerly."""
        no_adapters = self.lora is None or not self.lora.active
        tables, window_tables = inputs.tables, inputs.window_tables
        if (self.graphs is not None and inputs.all_single_token and no_adapters
                and self.graphs.applies(len(inputs.input_ids))
                and all(len(t) <= self.graphs.width for t in tables + window_tables)):
            windows = (zip(inputs.window_slots, map(tuple, window_tables)) if window_tables
                       else [(None, None)] * len(inputs.input_ids))
            graph_rows = [DecodeRow(*row, *window) for row, window in zip(
                zip(inputs.input_ids, inputs.positions, inputs.slot_mapping, map(tuple, tables)),
                windows)]
            return self.graphs.run(graph_rows, pending)
        if self.mixed_graphs is not None and no_adapters:
            mixed = MixedStep(inputs.input_ids, inputs.positions, inputs.slot_mapping,
                              inputs.query_start_loc, inputs.seq_lens, tables,
                              inputs.window_slots or None, window_tables or None)
            if self.mixed_graphs.fits(mixed):
                return self.mixed_graphs.run(mixed, pending)
        bs, device = self.block_size, self.device
        meta = AttentionMetadata.from_tables(
            inputs.slot_mapping, inputs.query_start_loc, inputs.seq_lens,
            self.table_rows.gather(inputs.rows, inputs.counts), bs, device)
        meta.num_requests = num_requests
        if window_tables:
            meta.window = AttentionMetadata.from_tables(
                inputs.window_slots, inputs.query_start_loc, inputs.seq_lens,
                self.window_table_rows.gather(inputs.window_rows, inputs.counts), bs, device)
        ids = to_device(inputs.input_ids, torch.long, device)
        if pending is not None:
            ids[pending[0]] = pending[1]
        position_ids = to_device(inputs.positions, torch.long, device)
        return self.model(ids, position_ids, self.kv_caches, meta)

    def _set_lora_batch(self, plan: SchedulerOutput) -> None:
        """Each token's adapter slot for this step; an adapter new to its slot is copied in."""
        token_slots, token_scales = [], []
        for item in plan.scheduled:
            if item.lora_slot >= 0:
                self.lora.load(item.lora_slot, self.adapters[item.request_id])
            token_slots += [item.lora_slot] * item.num_new_tokens
            token_scales += [item.lora_scale] * item.num_new_tokens
        self.lora.set_batch(token_slots, token_scales)

    def _logits(self, hidden: torch.Tensor, sample_indices: list[int]) -> torch.Tensor | None:
        if not sample_indices:
            return None
        return self.model.compute_logits(hidden[to_device(sample_indices, torch.long,
                                                          hidden.device)])

    def sample(self, step: LaunchedStep) -> None:
        """Draw the step's tokens where its logits are (not waiting for them), for the
        requests still here; the batch at once (a
        verifying request's rows each as if the proposals before them had been accepted),
        and if that fails request by request, so that only the requests that fail alone fail."""
        if step.logits is None:  # nobody samples, or the step failed
            return
        logits = step.logits
        here = [i for i, rid in enumerate(step.sampled_ids) if rid in self.sequences]
        request_ids = [step.sampled_ids[i] for i in here]
        if len(here) < len(step.sampled_ids):
            logits = logits[here]
        try:
            step.draws = [self._draw(logits, request_ids, step.drafts)]
        except Exception:  # noqa: BLE001 - isolate the request below
            for rid in dict.fromkeys(request_ids):
                index = [i for i, r in enumerate(request_ids) if r == rid]
                try:
                    step.draws.append(self._draw(logits[index], [rid] * len(index), step.drafts))
                except Exception as exc:  # noqa: BLE001 - fails this request only
                    step.failed[rid] = f"sampling failed: {type(exc).__name__}: {exc}"

    def _draw(self, logits: torch.Tensor, request_ids: list[str],
              drafts: dict[str, tuple[int, ...]]) -> SampledRows:
        """The rows' tokens; the sampling rows are made here (a grammar's masks along
        proposals too), so that whatever fails fails inside the isolation above."""
        rows = verification_rows(request_ids, self.sequences, drafts, self.config.vocab_size)
        if self.fault_injector is not None:
            for rid, row in zip(request_ids, rows):
                self.fault_injector(rid, row)
        return SampledRows(request_ids, logits, rows, self.sampler.draw(logits, rows))

    def collect(self, step: LaunchedStep) -> RunnerOutput:
        """The step's tokens on the host (the one wait of a step), each request's kept ones
        (after a verification: up to the first proposal that differs), its grammar walked
        on by them, and why each request that failed did."""
        if step.error is not None:
            return RunnerOutput(failed={item.request_id: step.error
                                        for item in step.plan.scheduled})
        result = RunnerOutput(failed=dict(step.failed))
        for draw in step.draws:
            try:
                tokens = draw.token_ids.tolist()
                logprobs = compute_logprobs(draw.logits, draw.token_ids, draw.rows)
            except Exception as exc:  # noqa: BLE001 - fails these requests only
                result.failed.update({rid: f"sampling failed: {type(exc).__name__}: {exc}"
                                      for rid in draw.request_ids})
                continue
            for rid, sampled in accepted_tokens(draw.request_ids, tokens, logprobs,
                                                step.drafts).items():
                row = self.sequences.get(rid)
                if row is None:  # ended since its draw
                    continue
                if row.grammar is not None:  # the walk goes on by every kept token
                    error = next((e for s in sampled
                                  if (e := _grammar_error(row, s.token_id)) is not None), None)
                    if error is not None:
                        result.failed[rid] = error
                        continue
                row.output_token_ids.extend(s.token_id for s in sampled)
                result.sampled[rid] = sampled
        return result


def _grammar_error(row: SamplingRow, token: int) -> str | None:
    """Advance the row's grammar by its sampled token; why the request fails, if it does."""
    if row.grammar.failed:
        # The library gave up (a limit, or a state it cannot go on from): an error for this
        # request, never a "stop" the grammar does not accept.
        return f"structured output failed: {row.grammar.error}"
    try:
        row.grammar.accept(token)
    except Exception as exc:  # noqa: BLE001 - fails this request only
        return f"grammar failed: {type(exc).__name__}: {exc}"
    return None
