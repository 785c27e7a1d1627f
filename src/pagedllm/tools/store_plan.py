"""`pagedllm plan --models-dir DIR`: what each model of a store holds once loaded (weights and
the KV cache its engine would size), and which of them fit in memory at once."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

from rich.console import Console
from rich.table import Table

from pagedllm.config import EngineConfig
from pagedllm.serving.model_loading import estimate_resident_bytes
from pagedllm.serving.model_store import StoreEntry
from pagedllm.units import gib


@dataclass(frozen=True)
class StoreRow:
    model: str
    path: str
    weight_bytes: int
    kv_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.kv_bytes


@dataclass(frozen=True)
class StorePlan:
    memory_bytes: int
    max_loaded_models: int
    rows: list[StoreRow]
    together: list[str]  # the most models resident at once, smallest first
    all_fit: bool
    too_large: list[str]  # models that do not fit even alone


def plan_store(entries: list[StoreEntry], base: EngineConfig, memory_bytes: int,
               max_loaded_models: int, estimate=estimate_resident_bytes) -> StorePlan:
    """Each model's resident size as the pool estimates it (its KV sized against the whole
    memory, as each engine sizes its own when it loads), and the largest set that is
    resident at once within memory_bytes and max_loaded_models."""
    rows = []
    for entry in entries:
        weights, kv = estimate(entry.engine_config(base), memory_bytes)
        rows.append(StoreRow(entry.name, entry.path, weights, kv))
    together, used = [], 0
    for row in sorted(rows, key=lambda r: r.total_bytes):
        if len(together) < max_loaded_models and used + row.total_bytes <= memory_bytes:
            together.append(row.model)
            used += row.total_bytes
    return StorePlan(memory_bytes, max_loaded_models, rows, together,
                     len(together) == len(rows),
                     [r.model for r in rows if r.total_bytes > memory_bytes])


def print_store_plan(plan: StorePlan, as_json: bool, console: Console | None = None) -> None:
    console = console or Console()
    if as_json:
        data = dataclasses.asdict(plan)
        for row, raw in zip(plan.rows, data["rows"]):
            raw["total_bytes"] = row.total_bytes
        print(json.dumps(data, indent=2))
        return
    console.print(f"model store: {len(plan.rows)} model(s); memory {gib(plan.memory_bytes)}, "
                  f"at most {plan.max_loaded_models} loaded at once")
    table = Table("model", "weights", "KV cache", "resident", "fits alone")
    for row in plan.rows:
        table.add_row(row.model, gib(row.weight_bytes), gib(row.kv_bytes), gib(row.total_bytes),
                      "yes" if row.model not in plan.too_large else "[red]no[/]")
    console.print(table)
    if plan.all_fit:
        console.print("[bold]every model fits at once[/]: none is unloaded to make room")
    else:
        console.print(f"at most {len(plan.together)} at once, for example: "
                      f"{', '.join(plan.together) or 'none'}; a request for another unloads "
                      f"the least recently used idle one first")
    for name in plan.too_large:
        console.print(f"[yellow]warning:[/] {name} does not fit even alone: give it a smaller "
                      f"kv-cache-memory in its [models] entry, or more memory")
