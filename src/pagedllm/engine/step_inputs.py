"""A step's plan (SchedulerOutput) as the lists the model call is built from: token ids,
positions, KV slots, the queries' bounds and context lengths, block-table rows, the rows
to sample. Plain Python; engine/model_runner.py turns them into tensors on its device.

A request that verifies proposals (num_draft_tokens > 0) enters as one single-token query
per position, each reading the same block table up to its own position (engine/verify.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from pagedllm.core.step_records import PLACEHOLDER, SchedulerOutput
from pagedllm.engine.block_table_rows import BlockTableRows
from pagedllm.engine.launched_step import LaunchedStep


@dataclass
class StepInputs:
    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slot_mapping: list[int] = field(default_factory=list)
    query_start_loc: list[int] = field(default_factory=lambda: [0])
    seq_lens: list[int] = field(default_factory=list)
    tables: list[list[int]] = field(default_factory=list)  # each query's block table
    rows: list[int] = field(default_factory=list)  # each query's row in BlockTableRows
    counts: list[int] = field(default_factory=list)  # each query's blocks in use
    # The sliding-window layers' own pool, where the model keeps them apart (else empty).
    window_slots: list[int] = field(default_factory=list)
    window_rows: list[int] = field(default_factory=list)
    window_tables: list[list[int]] = field(default_factory=list)
    sample_indices: list[int] = field(default_factory=list)  # tokens whose logits sample
    # Tokens sampled by the step still running (overlapped steps): where, and whose.
    pending_at: list[int] = field(default_factory=list)
    pending_of: list[str] = field(default_factory=list)

    @property
    def all_single_token(self) -> bool:
        """Every query one token (decode tokens, a verifying request's positions): to the
        model a decode step, which a CUDA graph can replay."""
        return len(self.input_ids) == len(self.seq_lens)


def prepare_inputs(plan: SchedulerOutput, block_size: int, table_rows: BlockTableRows,
                   window_table_rows: BlockTableRows, step: LaunchedStep) -> StepInputs:
    """The plan's inputs; the step learns which requests sample and what each verifies."""
    inputs = StepInputs()
    bs = block_size
    for item in plan.scheduled:
        start, end, table = item.start, item.start + item.num_new_tokens, item.block_table
        window = item.window_block_table
        row = table_rows.row_of(item.request_id, table)
        window_row = None if window is None else window_table_rows.row_of(item.request_id, window)
        for offset, token in enumerate(item.token_ids):
            if token == PLACEHOLDER:  # sampled by the previous step: filled in on the device
                inputs.pending_at.append(len(inputs.input_ids) + offset)
                inputs.pending_of.append(item.request_id)
        inputs.input_ids.extend(max(token, 0) for token in item.token_ids)
        inputs.positions.extend(range(start, end))
        inputs.slot_mapping.extend(table[p // bs] * bs + p % bs for p in range(start, end))
        if window is not None:
            inputs.window_slots.extend(window[p // bs] * bs + p % bs for p in range(start, end))
        # (query tokens, context length) of each query: one query of them all, or one per
        # position for a verifying request.
        queries = ([(1, p + 1) for p in range(start, end)] if item.num_draft_tokens
                   else [(item.num_new_tokens, end)])
        for num_queries, seq_len in queries:
            inputs.query_start_loc.append(inputs.query_start_loc[-1] + num_queries)
            inputs.seq_lens.append(seq_len)
            inputs.rows.append(row)
            inputs.counts.append(-(-seq_len // bs))
            inputs.tables.append(table)
            if window is not None:
                inputs.window_rows.append(window_row)
                inputs.window_tables.append(window)
            if item.samples:
                inputs.sample_indices.append(inputs.query_start_loc[-1] - 1)
                step.sampled_ids.append(item.request_id)
        if item.num_draft_tokens:
            step.drafts[item.request_id] = item.token_ids[1:]
    return inputs
