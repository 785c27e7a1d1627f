"""Building an engine's parts from its config: the checkpoint loaded, the model built on the
backend chosen once for this process, the KV pool sized, the scheduler's limits set. The
engine (engine.py) receives the finished parts; nothing here runs a step."""
from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass

import psutil
import torch

from pagedllm.backends import Backend, choose_backend
from pagedllm.config import (CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig,
                             exact_activations_for)
from pagedllm.model_config import ModelConfig
from pagedllm.core.kv_cache import KVCacheManager, WindowBlocks
from pagedllm.engine.draft_proposer import DraftProposer
from pagedllm.engine.kv_sizing import size_kv
from pagedllm.engine.model_runner import ModelRunner
from pagedllm.lora.registry import LoRARegistry
from pagedllm.lora.slots import LoRASlots
from pagedllm.models.build import build_model
from pagedllm.models.fp8_linear import check_fp8_weights
from pagedllm.structured.compiler import GrammarCompiler
from pagedllm.tokenizer import Tokenizer
from pagedllm.weights import load_checkpoint

logger = logging.getLogger("pagedllm")

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class EngineParts:
    config: EngineConfig
    backend: Backend
    model_config: ModelConfig
    model_path: str
    tokenizer: Tokenizer
    grammars: GrammarCompiler
    kv_memory_bytes: int
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    kv_manager: KVCacheManager
    runner: ModelRunner
    speculative: SpeculativeConfig  # the config's, its row limit lowered to the model's
    draft: DraftProposer | None = None  # with a draft model
    loras: LoRARegistry | None = None  # the adapters served, when LoRA is on


def engine_config(config: EngineConfig | str | None, settings: dict) -> EngineConfig:
    """EngineConfig(...) as given, or one made from a model path and settings."""
    if not isinstance(config, EngineConfig):
        return EngineConfig(model=config, **settings)
    return dataclasses.replace(config, **settings) if settings else config


def build_parts(config: EngineConfig, load_progress=None) -> EngineParts:
    # The backend first: a bad PAGEDLLM_CPU_ISA, an unusable --device or an option the
    # device cannot honour is a clear error before any loading.
    backend = choose_backend(config.device)
    _check_device_options(config, backend)
    started = time.monotonic()
    checkpoint = load_checkpoint(config.model, load_progress)
    model_config, model_path = checkpoint.config, checkpoint.path
    tokenizer = Tokenizer.from_checkpoint(checkpoint)
    torch_dtype = TORCH_DTYPES[config.dtype]
    check_fp8_weights(config, backend)
    adapters = _adapters(config, model_config)  # (a bad one refused before the build)
    net = build_model(model_config, checkpoint.weights, checkpoint.quantized, torch_dtype,
                      backend, int8_activations=not exact_activations_for(config, model_config),
                      device_four_bit=config.gpu_4bit_weights, device_fp8=config.gpu_fp8_weights)
    del checkpoint
    _return_freed_memory()
    kv_memory_bytes, cache_config, scheduler_config, window_blocks = size_kv(
        config, model_config, torch_dtype, backend.device)
    if net.serve_context(scheduler_config.max_model_len):
        logger.info("LongRoPE: the served context (%d tokens) is longer than the model's "
                    "original %d, so every request rotates with the long factors",
                    scheduler_config.max_model_len, model_config.rope_original_context)
    block_size = config.block_size
    window = None if window_blocks is None else WindowBlocks(
        window_blocks, block_size, model_config.sliding_window, config.enable_prefix_caching)
    kv_manager = KVCacheManager(cache_config.num_blocks, block_size, config.enable_prefix_caching,
                                window)
    graph_batch = _graph_batch(config, backend, net, scheduler_config)
    loras = _lora(config, model_config, net, torch_dtype, backend, adapters)
    runner = ModelRunner(net, model_config, cache_config.num_blocks, block_size, torch_dtype,
                         config.kv_cache_dtype, window_blocks, backend.device, graph_batch,
                         scheduler_config.max_model_len,
                         # Steps with prefill chunks too, unless a mixture of experts routes
                         # their tokens on the host; a verifying request adds a sequence a row.
                         graph_tokens=scheduler_config.max_num_batched_tokens
                         if net.max_graph_batch is None else None,
                         graph_sequences=(graph_batch or scheduler_config.max_num_seqs)
                         + config.speculative.max_rows)
    runner.lora = net.lora
    speculative = _speculative(config, net, backend)
    draft = None if speculative.draft_model is None else _draft_proposer(
        speculative.draft_model, model_config, cache_config, scheduler_config, torch_dtype,
        backend, config)
    parts = EngineParts(config, backend, model_config, model_path, tokenizer,
                        GrammarCompiler(tokenizer, model_config.vocab_size), kv_memory_bytes,
                        cache_config, scheduler_config, kv_manager, runner, speculative, draft,
                        loras)
    _log_loaded(parts, window_blocks, time.monotonic() - started)
    return parts


def _check_device_options(config: EngineConfig, backend: Backend) -> None:
    """Options only a GPU honours, refused before loading on anything else."""
    # (the graphs' buffers are read by the Triton attention, the GPU's)
    if config.cuda_graphs and not (backend.generic and backend.attention == "triton"):
        raise ValueError("--cuda-graphs needs --device cuda")
    if config.gpu_4bit_weights and not backend.generic:
        raise ValueError("--gpu-4bit-weights needs --device cuda (the CPU keeps 4-bit "
                         "weights 4-bit anyway)")
    if config.gpu_4bit_weights and config.dtype == "float32":
        raise ValueError("--gpu-4bit-weights needs --dtype bfloat16 (float32 is the exact "
                         "reference: every matrix dense)")


def _graph_batch(config: EngineConfig, backend: Backend, net,
                 scheduler_config: SchedulerConfig) -> int | None:
    """The largest decode step captured as a CUDA graph; None: no graphs. The graphs'
    static buffers are read by the Triton attention (the GPU's; on the CPU the tests'
    generic path with it under Triton's interpreter)."""
    graph_limit = net.max_graph_batch  # None: any batch; a mixture of experts: its small ones
    graphs = config.uses_cuda_graphs(backend.device, capturable=graph_limit != 0)
    if backend.device == "cuda" and graph_limit == 0 and config.cuda_graphs is None:
        logger.info("CUDA graphs off: this model's mixture-of-experts layers route tokens on "
                    "the host; its decode steps run eagerly")
    if not graphs:
        return None
    graph_batch = scheduler_config.max_num_seqs
    if graph_limit is not None and graph_limit < graph_batch:
        logger.info("CUDA graphs for decode steps of up to %d requests: this mixture of "
                    "experts routes larger steps' tokens on the host (eagerly)", graph_limit)
        graph_batch = graph_limit
    return graph_batch


def _speculative(config: EngineConfig, net, backend: Backend) -> SpeculativeConfig:
    """The speculative settings this model can run: a verifying step stays on the fused
    decode path, which takes up to its max_rows rows."""
    decode_loop = getattr(net, "decode_loop", None)
    speculative = config.speculative if decode_loop is None else dataclasses.replace(
        config.speculative, max_rows=min(config.speculative.max_rows, decode_loop.max_rows))
    if speculative.draft_model is not None and backend.generic:
        raise ValueError("--speculative draft does not run on the generic torch path (the "
                         "CUDA backend) yet; use --speculative ngram there")
    return speculative


def _adapters(config: EngineConfig, model_config: ModelConfig) -> LoRARegistry | None:
    """With LoRA on: the adapters named at start, each read and checked against the model's
    config before the model is built (a bad one stops the start with its one-line reason,
    without waiting for the load)."""
    if not config.lora.active:
        return None
    registry = LoRARegistry(model_config, config.lora)
    for name, path in config.lora.adapters:
        adapter = registry.load(name, path)
        logger.info("LoRA adapter %s: %s (%s, rank %d, %s), %.1f MiB", name, path,
                    adapter.source, adapter.rank, ", ".join(adapter.targets),
                    adapter.num_bytes / 2**20)
    return registry


def _lora(config: EngineConfig, model_config: ModelConfig, net, dtype: torch.dtype,
          backend: Backend, registry: LoRARegistry | None) -> LoRARegistry | None:
    """With LoRA on: the model's slots (its projections wrapped) for the adapters read."""
    if registry is None:
        return None
    net.lora = LoRASlots(net, model_config, config.lora, dtype, backend.device, backend.kernels)
    loop = getattr(net, "decode_loop", None)
    if loop is not None and not net.lora.attach_to_loop(loop):
        logger.info("LoRA: decode steps with adapters run the Python layers (the C++ decode "
                    "loop takes LoRA with the C++ kernels only)")
    logger.info("LoRA: %d slots of rank %d (--max-loras, --max-lora-rank), %.1f MiB",
                config.lora.max_loras, config.lora.max_lora_rank, net.lora.num_bytes / 2**20)
    return registry


def _draft_proposer(path: str, served: ModelConfig, cache: CacheConfig,
                    scheduler: SchedulerConfig, dtype: torch.dtype, backend: Backend,
                    config: EngineConfig) -> DraftProposer:
    """The draft model, built as the served one is, with a pool of as many tokens as the
    served model's (mapped as it is written)."""
    checkpoint = load_checkpoint(path)
    draft_config = checkpoint.config
    if draft_config.vocab_size != served.vocab_size:
        raise ValueError(f"the draft model {path} has a vocabulary of {draft_config.vocab_size} "
                         f"tokens, the served model {served.vocab_size}: a draft model must "
                         f"share the served model's tokenizer")
    if draft_config.sliding_window is not None:
        raise ValueError(f"the draft model {path} has sliding-window layers, which a draft "
                         f"model may not have yet")
    net = build_model(draft_config, checkpoint.weights, checkpoint.quantized, dtype, backend,
                      int8_activations=not exact_activations_for(config, draft_config))
    del checkpoint
    _return_freed_memory()
    logger.info("draft model %s (%s, %d layers) proposes up to %d tokens a step",
                path, draft_config.architecture, draft_config.num_layers,
                config.speculative.num_speculative_tokens)
    return DraftProposer(net, cache.num_blocks, cache.block_size, dtype,
                         min(draft_config.max_position_embeddings, scheduler.max_model_len),
                         scheduler.largest_step)


def _log_loaded(parts: EngineParts, window_blocks: int | None, seconds: float) -> None:
    model_config, cache, scheduler = parts.model_config, parts.cache_config, parts.scheduler_config
    if window_blocks is not None:
        logger.info("sliding-window layers (%d of %d, window %d tokens): a pool of their own, "
                    "%d blocks, freed as tokens slide out", len(model_config.sliding_layers),
                    model_config.num_layers, model_config.sliding_window, window_blocks)
    cpu = parts.backend.cpu
    amx = ""
    if cpu.has_amx and not cpu.amx and parts.backend.kernels is not None:
        amx = ("; AMX tiles unused (PAGEDLLM_CPU_AMX=0, a level below avx512, or the OS "
               "refused the tiles' state)")
    if cpu.int16 and parts.backend.kernels is not None:
        amx += "; few-row 4-bit products with 16-bit integer activations (PAGEDLLM_CPU_INT16)"
    logger.info("CPU kernels: %s (this CPU runs up to %s%s%s)",
                cpu.summary if parts.backend.kernels is not None else "none, torch fallback",
                cpu.best + ("+amx" if cpu.has_amx and cpu.best == "avx512" else ""),
                "; PAGEDLLM_CPU_ISA chose a lower level" if cpu.level != cpu.best else "", amx)
    capacity = cache.num_blocks * cache.block_size
    logger.info(
        "loaded %s (%s) in %.1fs, %s MiB resident; KV cache (%s): %d blocks x %d tokens = "
        "%d tokens (%s MiB); maximum concurrency for %d-token requests: %.2fx; "
        "max_num_seqs=%d",
        model_config.name, parts.config.dtype, seconds,
        f"{psutil.Process().memory_info().rss / 2**20:,.0f}", cache.cache_dtype,
        cache.num_blocks, cache.block_size, capacity, f"{parts.kv_memory_bytes / 2**20:,.0f}",
        scheduler.max_model_len,
        capacity / scheduler.max_model_len, scheduler.max_num_seqs)


def _return_freed_memory() -> None:
    """Loading frees ~1 GB of float32 staging tensors; glibc keeps freed memory mapped unless
    asked, so resident memory would stay at the loading peak."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
