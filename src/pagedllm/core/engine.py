"""LLMEngine: add_request / abort_request / step (the offline LLM.generate() is in llm.py)."""
from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass

import psutil
import torch

from pagedllm.core import sizing
from pagedllm.config import CacheConfig, EngineConfig, SchedulerConfig
from pagedllm.kernels import capabilities, kernel_ops
from pagedllm.core.kv_cache import KVCacheManager, WindowBlocks
from pagedllm.core.memory_guard import MemoryGuard
from pagedllm.core.model_runner import ModelRunner
from pagedllm.models.build import build_model
from pagedllm.core.output_processor import RequestTextState, stop_reason
from pagedllm.core.request import FinishReason, Request, RequestOutput, SamplingParams
from pagedllm.core.request_maker import RequestMaker
from pagedllm.core.scheduler import Scheduler
from pagedllm.core.snapshot import EngineSnapshot, take_snapshot
from pagedllm.core.step_records import RunnerOutput, SchedulerOutput
from pagedllm.structured.compiler import GrammarCompiler
from pagedllm.tokenizer import Tokenizer
from pagedllm.weights import load_checkpoint

logger = logging.getLogger("pagedllm")

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    kv_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    num_prompt_tokens: int
    num_generation_tokens: int
    last_step_tokens: int
    memory_pressure: bool = False  # new requests wait (core/memory_guard.py)


class LLMEngine(RequestMaker):
    def __init__(self, config: EngineConfig | str | None = None, *, load_progress=None,
                 **settings):
        """LLMEngine(EngineConfig(...)), or LLMEngine(model, **settings) for the same fields."""
        if not isinstance(config, EngineConfig):
            config = EngineConfig(model=config, **settings)
        elif settings:
            config = dataclasses.replace(config, **settings)
        self.config = config
        # The CPU level first: a bad PAGEDLLM_CPU_ISA is a clear error before any loading.
        self.cpu = capabilities()
        started = time.monotonic()
        checkpoint = load_checkpoint(config.model, load_progress)
        self.model_config = model_config = checkpoint.config
        self.model_path = checkpoint.path
        self.tokenizer = Tokenizer.from_checkpoint(checkpoint)
        self.grammars = GrammarCompiler(self.tokenizer, model_config.vocab_size)
        torch_dtype = TORCH_DTYPES[config.dtype]
        self.dtype = config.dtype
        block_size, kv_cache_dtype = config.block_size, config.kv_cache_dtype
        net = build_model(model_config, checkpoint.weights, checkpoint.quantized, torch_dtype,
                          int8_activations=not config.exact_activations)
        del checkpoint
        _return_freed_memory()

        element_size = torch.tensor([], dtype=torch_dtype).element_size()
        self.kv_memory_bytes = sizing.resolve_kv_memory(config.kv_cache_memory)
        num_blocks = sizing.num_blocks_for_memory(self.kv_memory_bytes, model_config, element_size,
                                                  block_size, kv_cache_dtype)
        if num_blocks < 1:
            raise ValueError(f"kv_cache_memory of {self.kv_memory_bytes} bytes holds no block of "
                             f"{block_size} tokens")
        longest = model_config.max_position_embeddings
        # Sliding-window layers next to full ones keep their own, smaller pool; the full
        # layers get the memory that saves (sizing.pool_sizes).
        pools = sizing.pool_sizes(
            self.kv_memory_bytes, model_config, element_size, block_size, kv_cache_dtype,
            config.max_num_seqs, min(config.max_model_len or longest, num_blocks * block_size),
            config.max_num_batched_tokens)
        num_blocks = pools.num_blocks
        capacity = num_blocks * block_size
        max_model_len = config.max_model_len
        if max_model_len is None:
            max_model_len = min(longest, capacity)
        if not 1 <= max_model_len <= longest:
            raise ValueError(f"max_model_len must be 1-{longest}, got {max_model_len}")
        if max_model_len > capacity:
            raise ValueError(f"max_model_len {max_model_len} exceeds the KV cache capacity of "
                             f"{capacity} tokens; raise kv_cache_memory or lower max_model_len")
        if net.serve_context(max_model_len):
            logger.info("LongRoPE: the served context (%d tokens) is longer than the model's "
                        "original %d, so every request rotates with the long factors",
                        max_model_len, model_config.rope_original_context)
        max_num_seqs = config.max_num_seqs
        if max_num_seqs == "auto":
            max_num_seqs = sizing.auto_max_num_seqs(num_blocks, block_size, max_model_len)
            if pools.max_num_seqs is not None:  # what the window pool was sized for
                max_num_seqs = min(max_num_seqs, pools.max_num_seqs)
        self.cache_config = CacheConfig(block_size, num_blocks, config.enable_prefix_caching,
                                        kv_cache_dtype)
        self.scheduler_config = SchedulerConfig(
            max_num_seqs=max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=max_model_len)
        window = None if pools.window_num_blocks is None else WindowBlocks(
            pools.window_num_blocks, block_size, model_config.sliding_window,
            config.enable_prefix_caching)
        self.kv_manager = KVCacheManager(num_blocks, block_size, config.enable_prefix_caching, window)
        self.scheduler = Scheduler(self.scheduler_config, self.kv_manager)
        self.runner = ModelRunner(net, model_config, num_blocks, block_size, torch_dtype,
                                  kv_cache_dtype, pools.window_num_blocks)
        if window is not None:
            logger.info("sliding-window layers (%d of %d, window %d tokens): a pool of their own, "
                        "%d blocks, freed as tokens slide out", len(model_config.sliding_layers),
                        model_config.num_layers, model_config.sliding_window,
                        pools.window_num_blocks)
        self.memory_guard = MemoryGuard(config.max_memory)
        self._paused_logged = False
        self._text_states: dict[str, RequestTextState] = {}
        # Read by other threads (metrics): replaced whole by the engine thread, never mutated.
        self._waiting_by_user: dict[str, int] = {}
        kernels = kernel_ops()
        logger.info("CPU kernels: %s (this CPU runs up to %s%s)",
                    self.cpu.level if kernels is not None else "none, torch fallback", self.cpu.best,
                    "; PAGEDLLM_CPU_ISA chose a lower level" if self.cpu.level != self.cpu.best else "")
        logger.info(
            "loaded %s (%s) in %.1fs, %.2f GiB resident; KV cache (%s): %d blocks x %d tokens = "
            "%d tokens (%.2f GiB); maximum concurrency for %d-token requests: %.2fx; "
            "max_num_seqs=%d",
            model_config.name, config.dtype, time.monotonic() - started,
            psutil.Process().memory_info().rss / 2**30, kv_cache_dtype, num_blocks,
            block_size, capacity,
            self.kv_memory_bytes / 2**30, max_model_len, capacity / max_model_len,
            self.scheduler_config.max_num_seqs)

    @property
    def capacity_tokens(self) -> int:
        return self.cache_config.num_blocks * self.cache_config.block_size

    # -- requests ---------------------------------------------------------------------------
    def add_request(self, request_id: str | None, prompt: str | list[int],
                    params: SamplingParams | None = None, *, user: str | None = None,
                    cache_salt: str | None = None) -> Request:
        request = self.make_request(request_id, prompt, params, user=user, cache_salt=cache_salt)
        self.add(request)
        return request

    def add(self, request: Request) -> None:
        self.scheduler.add_request(request)
        self.runner.add_request(request.request_id, request.params, request.prompt_token_ids,
                                request.grammar)
        self._text_states[request.request_id] = RequestTextState(request, self.tokenizer)
        self._publish()

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Abort in any state; blocks are free at once. Returns the final output, if known."""
        return self._end(request_id, FinishReason.ABORT)

    def fail_request(self, request_id: str, error: str) -> RequestOutput | None:
        """End one request with finish_reason "error" (its blocks freed), keeping the rest."""
        logger.error("request %s failed: %s", request_id, error)
        return self._end(request_id, FinishReason.ERROR, error)

    def _end(self, request_id: str, reason: FinishReason,
             error: str | None = None) -> RequestOutput | None:
        self.scheduler.finish_request(request_id, reason)
        self.runner.forget(request_id)
        state = self._text_states.pop(request_id, None)
        self._publish()
        if state is None:  # unknown, or already ended
            return None
        try:
            output = state.make_output()
        except Exception:  # noqa: BLE001 - making the output may be what failed
            output = RequestOutput(request_id, state.request.prompt_token_ids, [], "", [], "",
                                   True)
        return dataclasses.replace(output, finished=True, finish_reason=reason.value, error=error)

    def request_ids(self) -> list[str]:
        """Every unfinished request (engine thread)."""
        return list(self.scheduler.requests)

    def snapshot(self) -> EngineSnapshot:
        """Every KV block, the running and waiting requests, fair share (engine thread)."""
        return take_snapshot(self.scheduler)

    def queue_positions(self) -> list[str]:
        """Waiting request ids in the order they would be admitted (engine thread)."""
        return [request.request_id for request in self.scheduler.waiting.ordered()]

    def set_user_policies(self, weights: dict[str, float], max_running: dict[str, int]) -> None:
        """Fair-share weights and per-user caps on running requests (engine thread)."""
        self.scheduler.waiting.weights = dict(weights)
        self.scheduler.max_running_per_user = dict(max_running)

    def waiting_by_user(self) -> dict[str, int]:
        """Waiting requests per user as of the last step: safe to read from any thread."""
        return self._waiting_by_user

    def _publish(self) -> None:
        self._waiting_by_user = self.scheduler.waiting.waiting_by_user()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # -- the loop ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, execute, update: one step of every running request."""
        self.scheduler.admission_paused = paused = self.memory_guard.under_pressure()
        if paused and not self._paused_logged:
            logger.warning("memory pressure (%s): new requests wait", self.memory_guard.reason)
        self._paused_logged = paused
        plan = self.scheduler.schedule()
        if plan.is_empty:
            return []
        try:
            result = self.runner.execute(plan)
        except Exception as exc:  # noqa: BLE001 - a batched forward: its requests fail, not the engine
            logger.exception("model step over %d requests failed", len(plan.scheduled))
            result = RunnerOutput(failed={item.request_id: f"the model step failed: "
                                          f"{type(exc).__name__}: {exc}" for item in plan.scheduled})
        return self._update(plan, result)

    def _update(self, plan: SchedulerOutput, result: RunnerOutput) -> list[RequestOutput]:
        """Fail what failed, append the sampled tokens, let the output processor decide every
        stop, and free what stopped: the one place a request finishes (besides an abort)."""
        outputs = [out for rid, error in result.failed.items()
                   if (out := self.fail_request(rid, error)) is not None]
        for request in self.scheduler.update_from_output(plan, result):
            rid = request.request_id
            try:
                state = self._text_states[rid]
                reason = stop_reason(request, state)
                if reason is not None:
                    self.scheduler.finish_request(rid, reason)
                outputs.append(state.make_output())
            except Exception as exc:  # noqa: BLE001 - e.g. detokenizing: this request only
                outputs.append(self.fail_request(rid, f"{type(exc).__name__}: {exc}"))
                continue
            if reason is not None:
                del self._text_states[rid]
                self.runner.forget(rid)
        self._publish()
        return outputs

    def stats(self) -> EngineStats:
        s = self.scheduler.stats
        kv = self.kv_manager
        return EngineStats(
            num_running=self.scheduler.num_running, num_waiting=self.scheduler.num_waiting,
            kv_blocks_used=kv.num_blocks - kv.num_free_blocks, kv_blocks_total=kv.num_blocks,
            kv_usage=kv.usage(), prefix_cache_queries=s.prefix_cache_queries,
            prefix_cache_hits=s.prefix_cache_hits, num_preemptions=s.num_preemptions,
            num_prompt_tokens=s.num_prompt_tokens, num_generation_tokens=s.num_generation_tokens,
            last_step_tokens=s.last_step_tokens, memory_pressure=self.scheduler.admission_paused)


def _return_freed_memory() -> None:
    """Loading frees ~1 GB of float32 staging tensors; glibc keeps freed memory mapped unless
    asked, so resident memory would stay at the loading peak."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
