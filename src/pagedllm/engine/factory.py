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
from pagedllm.config import (CacheConfig, EngineConfig, ModelConfig, SchedulerConfig,
                             SpeculativeConfig, exact_activations_for)
from pagedllm.core import sizing
from pagedllm.core.kv_cache import KVCacheManager, WindowBlocks
from pagedllm.engine.draft_proposer import DraftProposer
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
    # The backend first: a bad PAGEDLLM_CPU_ISA or an unusable --device is a clear error
    # before any loading.
    backend = choose_backend(config.device)
    # (before loading: the graphs' buffers are read by the Triton attention, the GPU's)
    if config.cuda_graphs and not (backend.generic and backend.attention == "triton"):
        raise ValueError("--cuda-graphs needs --device cuda")
    started = time.monotonic()
    checkpoint = load_checkpoint(config.model, load_progress)
    model_config, model_path = checkpoint.config, checkpoint.path
    tokenizer = Tokenizer.from_checkpoint(checkpoint)
    torch_dtype = TORCH_DTYPES[config.dtype]
    if config.gpu_4bit_weights and not backend.generic:
        raise ValueError("--gpu-4bit-weights needs --device cuda (the CPU keeps 4-bit "
                         "weights 4-bit anyway)")
    if config.gpu_4bit_weights and config.dtype == "float32":
        raise ValueError("--gpu-4bit-weights needs --dtype bfloat16 (float32 is the exact "
                         "reference: every matrix dense)")
    check_fp8_weights(config, backend)
    adapters = _adapters(config, model_config)  # (a bad one refused before the build)
    net = build_model(model_config, checkpoint.weights, checkpoint.quantized, torch_dtype,
                      backend, int8_activations=not exact_activations_for(config, model_config),
                      device_four_bit=config.gpu_4bit_weights, device_fp8=config.gpu_fp8_weights)
    del checkpoint
    _return_freed_memory()
    kv_memory_bytes, cache_config, scheduler_config, window_blocks = _size_kv(
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
    # The graphs' static buffers are read by the Triton attention (the GPU's; on the CPU
    # the tests' generic path with it under Triton's interpreter).
    graph_limit = net.max_graph_batch  # None: any batch; a mixture of experts: its small ones
    graphs = config.uses_cuda_graphs(backend.device, capturable=graph_limit != 0)
    if backend.device == "cuda" and graph_limit == 0 and config.cuda_graphs is None:
        logger.info("CUDA graphs off: this model's mixture-of-experts layers route tokens on "
                    "the host; its decode steps run eagerly")
    graph_batch = scheduler_config.max_num_seqs
    if graphs and graph_limit is not None and graph_limit < graph_batch:
        logger.info("CUDA graphs for decode steps of up to %d requests: this mixture of "
                    "experts routes larger steps' tokens on the host (eagerly)", graph_limit)
        graph_batch = graph_limit
    loras = _lora(config, model_config, net, torch_dtype, backend, adapters)
    runner = ModelRunner(net, model_config, cache_config.num_blocks, block_size, torch_dtype,
                         config.kv_cache_dtype, window_blocks, backend.device,
                         graph_batch if graphs else None, scheduler_config.max_model_len,
                         # Steps with prefill chunks too, unless a mixture of experts routes
                         # their tokens on the host; a verifying request adds a sequence a row.
                         graph_tokens=scheduler_config.max_num_batched_tokens
                         if graph_limit is None else None,
                         graph_sequences=graph_batch + config.speculative.max_rows)
    runner.lora = net.lora
    # A verifying step stays on the fused decode path, which takes up to max_rows rows.
    decode_loop = getattr(net, "decode_loop", None)
    speculative = config.speculative if decode_loop is None else dataclasses.replace(
        config.speculative, max_rows=min(config.speculative.max_rows, decode_loop.max_rows))
    if speculative.draft_model is not None and backend.generic:
        raise ValueError("--speculative draft does not run on the generic torch path (the "
                         "CUDA backend) yet; use --speculative ngram there")
    draft = None if speculative.draft_model is None else _draft_proposer(
        speculative.draft_model, model_config, cache_config, scheduler_config, torch_dtype,
        backend, config)
    parts = EngineParts(config, backend, model_config, model_path, tokenizer,
                        GrammarCompiler(tokenizer, model_config.vocab_size), kv_memory_bytes,
                        cache_config, scheduler_config, kv_manager, runner, speculative, draft,
                        loras)
    _log_loaded(parts, window_blocks, time.monotonic() - started)
    return parts


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


def _size_kv(config: EngineConfig, model_config: ModelConfig, torch_dtype: torch.dtype,
             device: str = "cpu") -> tuple[int, CacheConfig, SchedulerConfig, int | None]:
    """The KV pool (bytes, blocks; the sliding-window layers' own pool where they keep one)
    and the scheduler's limits that follow from it. On a GPU without --kv-cache-memory: what
    --gpu-memory-utilization leaves once the weights are loaded (sizing.gpu_kv_memory)."""
    block_size, kv_cache_dtype = config.block_size, config.kv_cache_dtype
    element_size = torch.tensor([], dtype=torch_dtype).element_size()
    longest = model_config.max_position_embeddings
    full_request = sizing.kv_bytes_per_request(model_config, element_size, kv_cache_dtype,
                                               config.max_model_len or longest, block_size)
    if device == "cuda" and config.kv_cache_memory is None:
        free, total = torch.cuda.mem_get_info()
        kv_memory_bytes = sizing.gpu_kv_memory(
            free, total, config.gpu_memory_utilization,
            full_request if config.shares_device else None)
    else:
        kv_memory_bytes = sizing.resolve_kv_memory(config.kv_cache_memory, full_request)
    num_blocks = sizing.num_blocks_for_memory(kv_memory_bytes, model_config, element_size,
                                              block_size, kv_cache_dtype)
    if num_blocks < 1:
        raise ValueError(f"kv_cache_memory of {kv_memory_bytes} bytes holds no block of "
                         f"{block_size} tokens")
    # Sliding-window layers next to full ones keep their own, smaller pool; the full layers
    # get the memory that saves (sizing.pool_sizes).
    pools = sizing.pool_sizes(
        kv_memory_bytes, model_config, element_size, block_size, kv_cache_dtype,
        config.max_num_seqs, min(config.max_model_len or longest, num_blocks * block_size),
        config.step_budget(device))
    capacity = pools.num_blocks * block_size
    max_model_len = config.max_model_len
    if max_model_len is None:
        max_model_len = min(longest, capacity)
        if max_model_len < longest:  # say it: a bigger model silently got a short context
            logger.warning(
                "the KV cache (%d MiB) holds %d tokens, less than the model's context of %d: "
                "serving up to %d; --kv-cache-memory %d MiB would hold one full-context "
                "request (`pagedllm plan` sizes more), or set --max-model-len",
                kv_memory_bytes >> 20, capacity, longest, max_model_len,
                -(-full_request >> 20))
    if not 1 <= max_model_len <= longest:
        raise ValueError(f"max_model_len must be 1-{longest}, got {max_model_len}")
    if max_model_len > capacity:
        raise ValueError(f"max_model_len {max_model_len} exceeds the KV cache capacity of "
                         f"{capacity} tokens; raise kv_cache_memory or lower max_model_len")
    max_num_seqs = config.max_num_seqs
    if max_num_seqs == "auto":
        max_num_seqs = sizing.auto_max_num_seqs(pools.num_blocks, block_size, max_model_len,
                                                sizing.auto_max_num_seqs_cap(device))
        if pools.max_num_seqs is not None:  # what the window pool was sized for
            max_num_seqs = min(max_num_seqs, pools.max_num_seqs)
    cache_config = CacheConfig(block_size, pools.num_blocks, config.enable_prefix_caching,
                               kv_cache_dtype)
    # A window pool is sized for steps of step_budget tokens (sizing.window_pool_blocks, as
    # `pagedllm plan` counts it): its models keep that bound in every step.
    alone = (config.step_budget(device) if pools.window_num_blocks is not None
             else config.prefill_alone_budget(device))
    scheduler_config = SchedulerConfig(max_num_seqs=max_num_seqs,
                                       max_num_batched_tokens=config.step_budget(device),
                                       max_model_len=max_model_len,
                                       prefill_alone_tokens=alone)
    return kv_memory_bytes, cache_config, scheduler_config, pools.window_num_blocks


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
