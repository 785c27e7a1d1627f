"""`pagedllm plan`: how much memory N parallel requests at context L need, and how many fit."""
from __future__ import annotations

import dataclasses
import json
import shlex
from dataclasses import dataclass

from rich.console import Console
from rich.table import Table

from pagedllm.config import DEFAULT_BLOCK_SIZE, DEFAULT_DTYPE, DEFAULT_MAX_NUM_BATCHED_TOKENS
from pagedllm.core import sizing
from pagedllm.units import byte_text, gib

MIB = 1 << 20
from pagedllm.weights.inspect import summarize_checkpoint


class ContextTooLongError(ValueError):
    """A context the model cannot serve (the server would refuse it as --max-model-len)."""


@dataclass(frozen=True)
class ParallelFit:
    parallel: int
    kv_bytes: int  # parallel x context, rounded up to whole blocks
    total_bytes: int  # weights + KV
    fits: bool


@dataclass(frozen=True)
class CapacityPlan:
    model: str
    dtype: str
    kv_cache_dtype: str
    context: int
    block_size: int
    kv_bytes_per_token: int
    kv_bytes_per_request: int  # one full-context request, whole blocks
    kv_bytes_per_step: int  # sliding-window layers: a step's prefill chunks (0 without them)
    weight_bytes: int
    memory_bytes: int
    kv_budget_bytes: int  # memory - weights
    max_parallel: int  # largest parallel count that fits
    rows: list[ParallelFit]
    warnings: list[str]
    model_path: str | None = None  # as given to plan (None: the bundled default model)
    device: str = "cpu"  # where the server will run it (serve --device)
    gpu_4bit_weights: bool = False  # serve --gpu-4bit-weights: 4-bit projections stay 4-bit
    # How memory_bytes was chosen, said with the plan ("" when --memory gave it).
    memory_rule: str = ""
    # LoRA (counted in weight_bytes): the slots, the adapters named, and serve's options.
    lora_bytes: int = 0
    lora_args: tuple[str, ...] = ()


def plan_capacity(summary, *, dtype: str, element_size: int, context: int, parallels: list[int],
                  memory_bytes: int, block_size: int = DEFAULT_BLOCK_SIZE, kv_cache_dtype: str = "auto",
                  four_bit_on_device: bool = False, lora_bytes: int = 0) -> CapacityPlan:
    """Memory = weights (and LoRA: lora_bytes) + parallel x context x KV bytes per token
    (whole blocks; sliding-window layers of a model that keeps them apart count their
    window, not the context)."""
    config = summary.config
    per_token = sizing.kv_bytes_per_token(config, element_size, kv_cache_dtype)
    per_request = sizing.kv_bytes_per_request(config, element_size, kv_cache_dtype, context, block_size)
    per_step = 0
    if sizing.keeps_window_pool(config):  # the window pool's room for a step's chunks (pool_sizes)
        per_step = (per_token // config.num_layers * len(config.sliding_layers) * block_size
                    * sizing.blocks_for_tokens(DEFAULT_MAX_NUM_BATCHED_TOKENS, block_size))
    weight_bytes = summary.weight_bytes(element_size, four_bit_on_device) + lora_bytes
    budget = max(0, memory_bytes - weight_bytes)
    rows = [ParallelFit(n, n * per_request + per_step, weight_bytes + n * per_request + per_step,
                        weight_bytes + n * per_request + per_step <= memory_bytes)
            for n in parallels]
    if context > config.max_position_embeddings:
        raise ContextTooLongError(f"a context of {context} tokens is longer than {config.name}'s "
                                  f"{config.max_position_embeddings}; plan for at most that")
    warnings = []
    if weight_bytes > memory_bytes:
        warnings.append(f"the weights alone need {gib(weight_bytes)}, more than the {gib(memory_bytes)} given")
    for row in rows:
        if not row.fits:
            warnings.append(f"{row.parallel} x {context} tokens needs {gib(row.total_bytes)} "
                            f"(weights {gib(weight_bytes)} + KV {gib(row.kv_bytes)}), "
                            f"more than the {gib(memory_bytes)} given")
    return CapacityPlan(config.name, dtype, kv_cache_dtype, context, block_size, per_token,
                        per_request, per_step, weight_bytes, memory_bytes, budget,
                        max(0, budget - per_step) // per_request if per_request else 0, rows,
                        warnings, lora_bytes=lora_bytes)


SHARED_MACHINE_SHARE = 0.5  # of what is available after the weights, when --memory is not given


def shared_machine_memory(weight_bytes: int, available: int) -> int:
    """What a plan may use on a machine it does not own: the weights and half of what is left
    (the same half serve's own default KV sizing never passes), so the other users and the
    OS keep the rest."""
    return weight_bytes + int(max(0, available - weight_bytes) * SHARED_MACHINE_SHARE)


def make_plan(model: str | None, *, dtype: str, context: int | None, parallels: list[int],
              memory: int | None, block_size: int = DEFAULT_BLOCK_SIZE,
              kv_cache_dtype: str = "auto", device: str = "cpu",
              gpu_memory_utilization: float = 0.9, gpu_4bit_weights: bool = False,
              lora=None) -> CapacityPlan:
    """device cuda: the memory is the GPU's share the server may hold (`serve
    --gpu-memory-utilization`) unless `memory` is given (planning a card from elsewhere);
    the weights count dense in the dtype, as the CUDA backend holds them, but for the 4-bit
    projections with gpu_4bit_weights. lora: serve's LoRAConfig (its slots and adapters
    counted with the weights)."""
    if gpu_4bit_weights and device != "cuda":
        raise ValueError("--gpu-4bit-weights plans a GPU: give --device cuda")
    summary = summarize_checkpoint(model)
    if context is None:  # serve's own default: the model's whole context
        context = summary.config.max_position_embeddings
    rule = ""
    if memory is not None:
        memory_bytes = memory
    elif device == "cuda":
        memory_bytes = gpu_memory_share(gpu_memory_utilization)
        rule = (f"the card's share by --gpu-memory-utilization {gpu_memory_utilization:g} "
                f"(--memory plans another amount)")
    else:
        available = sizing.available_memory_bytes()
        element = sizing.ELEMENT_SIZES[dtype]
        memory_bytes = shared_machine_memory(summary.weight_bytes(element, False), available)
        rule = (f"the weights and half of what this machine has available after them "
                f"({gib(available)} available), leaving the rest to its other users "
                f"(--memory plans another amount)")
    lora_bytes, lora_args = _lora_memory(summary.config, lora, sizing.ELEMENT_SIZES[dtype])
    plan = plan_capacity(summary, dtype=dtype, element_size=sizing.ELEMENT_SIZES[dtype],
                         context=context, parallels=parallels, memory_bytes=memory_bytes,
                         block_size=block_size, kv_cache_dtype=kv_cache_dtype,
                         four_bit_on_device=gpu_4bit_weights, lora_bytes=lora_bytes)
    return dataclasses.replace(plan, model_path=model, device=device,
                               gpu_4bit_weights=gpu_4bit_weights, memory_rule=rule,
                               lora_args=lora_args)


def _lora_memory(config, lora, element_size: int) -> tuple[int, tuple[str, ...]]:
    """LoRA's bytes (the slots in the model's dtype; each adapter read and checked, held in
    float32) and the serve options that give them."""
    if lora is None or not lora.active:
        return 0, ()
    from pagedllm.lora import load_adapter

    total = sizing.lora_slot_bytes(config, lora.max_loras, lora.max_lora_rank, element_size)
    args = [f"--max-loras {lora.max_loras}", f"--max-lora-rank {lora.max_lora_rank}"]
    for name, path in lora.adapters:
        total += load_adapter(name, path, config, lora.max_lora_rank).num_bytes
        args.append(f"--lora {shlex.quote(f'{name}={path}')}")
    if lora.enabled and not lora.adapters:
        args.append("--enable-lora")
    return total, tuple(args)


class NoGPUError(ValueError):
    """plan --device cuda on a machine without a usable GPU and without --memory."""


def gpu_memory_share(utilization: float) -> int:
    """The bytes of this machine's GPU a server with --gpu-memory-utilization may hold."""
    import torch

    if not torch.cuda.is_available():
        raise NoGPUError("--device cuda: this machine has no usable CUDA GPU; give the card's "
                         "memory with --memory (e.g. --memory 80GiB) to plan for one")
    _, total = torch.cuda.mem_get_info()
    return int(total * utilization)


def print_plan(plan: CapacityPlan, as_json: bool, console: Console | None = None) -> None:
    console = console or Console()
    if as_json:
        print(json.dumps(dataclasses.asdict(plan), indent=2))
        return
    g = gib
    console.print(f"model {plan.model} ({plan.dtype}, on {plan.device}), context "
                  f"{plan.context} tokens, block size {plan.block_size}")
    formula = ("2 x layers x kv_heads x (head_dim int8 codes + a 4-byte scale)"
               if plan.kv_cache_dtype == "int8" else "2 x layers x kv_heads x head_dim x bytes")
    console.print(f"KV cache ({plan.kv_cache_dtype}): {plan.kv_bytes_per_token:,} bytes per token = "
                  f"{formula}; {g(plan.kv_bytes_per_request)} per full-context request")
    if plan.kv_bytes_per_step:
        console.print(f"sliding-window layers hold a request's window, not its context "
                      f"(counted above), plus {g(plan.kv_bytes_per_step)} for a step's prefill chunks")
    lora = f" (LoRA slots and adapters: {g(plan.lora_bytes)})" if plan.lora_bytes else ""
    console.print(f"weights: {g(plan.weight_bytes)}{lora}; memory: {g(plan.memory_bytes)}; "
                  f"left for KV: {g(plan.kv_budget_bytes)}")
    if plan.memory_rule:
        console.print(f"memory planned: {plan.memory_rule}")
    table = Table("parallel", "KV memory", "weights + KV", "fits")
    for row in plan.rows:
        table.add_row(str(row.parallel), g(row.kv_bytes), g(row.total_bytes),
                      "yes" if row.fits else "[red]no[/]")
    console.print(table)
    console.print(f"largest parallel count that fits: [bold]{plan.max_parallel}[/]; serve it "
                  f"with:")
    # One line whatever the terminal (rich would wrap it): to paste, or to grep from a pipe.
    console.print(serve_command(plan), soft_wrap=True, highlight=False, markup=False)
    for warning in plan.warnings:
        console.print(f"[yellow]warning:[/] {warning}")


def serve_command(plan: CapacityPlan) -> str:
    """The `serve` command that runs what this plan sized, ready to paste (the model too)."""
    words = ["pagedllm serve"]
    if plan.model_path is not None:
        words.append(f"--model {shlex.quote(plan.model_path)}")
    if plan.device != "cpu":
        words.append(f"--device {plan.device}")
    if plan.gpu_4bit_weights:
        words.append("--gpu-4bit-weights")
    kv_bytes = max(plan.max_parallel, 1) * plan.kv_bytes_per_request + plan.kv_bytes_per_step
    words += [f"--max-num-seqs {max(plan.max_parallel, 1)}",
             f"--max-model-len {plan.context}",
             f"--kv-cache-memory {byte_text(-(-kv_bytes // MIB) * MIB)}"]  # whole MiB, up
    if plan.dtype != DEFAULT_DTYPE:
        words.append(f"--dtype {plan.dtype}")
    if plan.kv_cache_dtype != "auto":
        words.append(f"--kv-cache-dtype {plan.kv_cache_dtype}")
    if plan.block_size != DEFAULT_BLOCK_SIZE:
        words.append(f"--block-size {plan.block_size}")
    words += plan.lora_args
    return " ".join(words)
