"""`pagedllm plan`: how much memory N parallel requests at context L need, and how many fit."""
from __future__ import annotations

import dataclasses
import json

from rich.console import Console
from rich.table import Table

from pagedllm.config import DEFAULT_BLOCK_SIZE, DEFAULT_DTYPE
from pagedllm.core import sizing
from pagedllm.weights.inspect import summarize_checkpoint



def make_plan(model: str | None, *, dtype: str, context: int, parallels: list[int],
              memory: int | None, block_size: int = DEFAULT_BLOCK_SIZE,
              kv_cache_dtype: str = "auto") -> sizing.CapacityPlan:
    summary = summarize_checkpoint(model)
    memory_bytes = memory if memory is not None else sizing.available_memory_bytes()
    return sizing.plan_capacity(summary, dtype=dtype, element_size=sizing.ELEMENT_SIZES[dtype],
                                context=context, parallels=parallels, memory_bytes=memory_bytes,
                                block_size=block_size, kv_cache_dtype=kv_cache_dtype)


def print_plan(plan: sizing.CapacityPlan, as_json: bool, console: Console | None = None) -> None:
    console = console or Console()
    if as_json:
        print(json.dumps(dataclasses.asdict(plan), indent=2))
        return
    g = sizing.gib
    console.print(f"model {plan.model} ({plan.dtype}), context {plan.context} tokens, "
                  f"block size {plan.block_size}")
    formula = ("2 x layers x kv_heads x (head_dim int8 codes + a 4-byte scale)"
               if plan.kv_cache_dtype == "int8" else "2 x layers x kv_heads x head_dim x bytes")
    console.print(f"KV cache ({plan.kv_cache_dtype}): {plan.kv_bytes_per_token:,} bytes per token = "
                  f"{formula}; {g(plan.kv_bytes_per_request)} per full-context request")
    if plan.kv_bytes_per_step:
        console.print(f"sliding-window layers hold a request's window, not its context "
                      f"(counted above), plus {g(plan.kv_bytes_per_step)} for a step's prefill chunks")
    console.print(f"weights: {g(plan.weight_bytes)}; memory: {g(plan.memory_bytes)}; "
                  f"left for KV: {g(plan.kv_budget_bytes)}")
    table = Table("parallel", "KV memory", "weights + KV", "fits")
    for row in plan.rows:
        table.add_row(str(row.parallel), g(row.kv_bytes), g(row.total_bytes),
                      "yes" if row.fits else "[red]no[/]")
    console.print(table)
    console.print(f"largest parallel count that fits: [bold]{plan.max_parallel}[/] "
                  f"({serve_command(plan)})")
    for warning in plan.warnings:
        console.print(f"[yellow]warning:[/] {warning}")


def serve_command(plan: sizing.CapacityPlan) -> str:
    """The `serve` flags that run what this plan sized."""
    words = ["pagedllm serve", f"--max-num-seqs {max(plan.max_parallel, 1)}",
             f"--max-model-len {plan.context}",
             f"--kv-cache-memory {max(plan.max_parallel, 1) * plan.kv_bytes_per_request + plan.kv_bytes_per_step}"]
    if plan.dtype != DEFAULT_DTYPE:
        words.append(f"--dtype {plan.dtype}")
    if plan.kv_cache_dtype != "auto":
        words.append(f"--kv-cache-dtype {plan.kv_cache_dtype}")
    if plan.block_size != DEFAULT_BLOCK_SIZE:
        words.append(f"--block-size {plan.block_size}")
    return " ".join(words)
