"""LLMEngine: add_request / abort_request / step (the offline LLM.generate() is in llm.py).
Its parts are built by factory.py; it owns them and is stepped by one thread."""
from __future__ import annotations

import dataclasses
import logging

from pagedllm.config import EngineConfig
from pagedllm.core.output_processor import RequestTextState, stop_reason
from pagedllm.core.request import FinishReason, Request, RequestOutput, SamplingParams
from pagedllm.core.output_budget import OutputCaps
from pagedllm.core.lora_slot_table import LoRASlotTable
from pagedllm.core.scheduler import Scheduler
from pagedllm.core.speculation import Speculator
from pagedllm.core.snapshot import EngineSnapshot, EngineStats, take_snapshot
from pagedllm.core.step_records import RunnerOutput, SchedulerOutput
from pagedllm.engine.factory import EngineParts, build_parts, engine_config
from pagedllm.engine.faults import Faults
from pagedllm.engine.launched_step import LaunchedStep
from pagedllm.engine.memory_guard import MemoryGuard
from pagedllm.engine.overlap import StepOverlap
from pagedllm.engine.request_maker import RequestMaker
from pagedllm.errors import AdapterError

logger = logging.getLogger("pagedllm")


class LLMEngine:
    def __init__(self, config: EngineConfig | str | None = None, *, load_progress=None,
                 faults: Faults | None = None, detokenize: bool = True, **settings):
        """LLMEngine(EngineConfig(...)), or LLMEngine(model, **settings) for the same fields.
        faults: failures to inject (tests; engine/faults.py), none by default.
        detokenize=False: outputs carry token ids only, and stop strings are the caller's
        to find (the engine-core process, whose front end detokenizes)."""
        config = engine_config(config, settings)
        parts: EngineParts = build_parts(config, load_progress)
        self.config = config
        self.backend = parts.backend
        self.cpu = parts.backend.cpu
        self.model_config, self.model_path = parts.model_config, parts.model_path
        self.tokenizer, self.grammars = parts.tokenizer, parts.grammars
        self.dtype = config.dtype
        self.kv_memory_bytes = parts.kv_memory_bytes
        self.cache_config, self.scheduler_config = parts.cache_config, parts.scheduler_config
        self.kv_manager, self.runner = parts.kv_manager, parts.runner
        # LoRA adapters, when served: by name (lora/registry.py), and their slots' bookkeeping.
        self.loras = parts.loras
        self.scheduler = Scheduler(self.scheduler_config, self.kv_manager, None
                                   if self.loras is None else LoRASlotTable(config.lora.max_loras))
        self.speculator = Speculator(parts.speculative, parts.draft)
        self.requests = RequestMaker(self.tokenizer, self.model_config.vocab_size,
                                     self.scheduler_config.max_model_len, self.grammars,
                                     has_draft_model=self.speculator.draft is not None,
                                     adapters=self.loras)
        self.faults = faults or Faults()
        self.runner.fault_injector = self.faults.sampling_fault()
        self.memory_guard = MemoryGuard(config.max_memory)
        # Overlapped steps: whether they apply, and the step launched and not yet collected.
        self.overlap = StepOverlap(config.overlaps_steps(self.backend.device), self.speculator)
        self._launched: LaunchedStep | None = None
        self._paused_logged = False
        self.detokenize = detokenize
        self._text_states: dict[str, RequestTextState] = {}
        # Read by other threads (metrics): replaced whole by the engine thread, never mutated.
        self.published: EngineStats = self._stats()
        self._waiting_by_user: dict[str, int] = {}

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

    def make_request(self, request_id: str | None, prompt: str | list[int],
                     params: SamplingParams | None = None, *, user: str | None = None,
                     cache_salt: str | None = None, caps: OutputCaps | None = None) -> Request:
        """A checked request, not yet added (request_maker.py); safe from any thread."""
        return self.requests.make_request(request_id, prompt, params, user=user,
                                          cache_salt=cache_salt, caps=caps)

    def add(self, request: Request) -> None:
        """Raises AdapterError for an adapter not (or no longer) loaded: nothing is added."""
        adapter = None
        if request.params.lora is not None:
            adapter = self.loras.get(request.params.lora) if self.loras is not None else None
            if adapter is None:
                raise AdapterError(f"the adapter {request.params.lora} is not loaded")
            request.lora_key = adapter.key
            self.loras.requests_served[adapter.name] = (
                self.loras.requests_served.get(adapter.name, 0) + 1)
        self.scheduler.add_request(request)
        self.runner.add_request(request.request_id, request.params, request.prompt_token_ids,
                                request.grammar, adapter)
        self._text_states[request.request_id] = RequestTextState(
            request, self.tokenizer if self.detokenize else None)
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
        self.speculator.forget(request_id)
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
        """Replace the figures other threads read (never mutated after)."""
        self._waiting_by_user = self.scheduler.waiting.waiting_by_user()
        self.published = self._stats()

    def has_unfinished_requests(self) -> bool:
        """Requests not finished, or a step still to collect (overlapped steps)."""
        return self.scheduler.has_unfinished_requests() or self._launched is not None

    # -- the loop ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, execute, update: one step of every running request."""
        self.scheduler.admission_paused = paused = self.memory_guard.under_pressure()
        if paused and not self._paused_logged:
            logger.warning("memory pressure (%s): new requests wait", self.memory_guard.reason)
        self._paused_logged = paused
        self.faults.before_step()
        if self.loras is not None:
            for key in self.loras.take_unloaded():
                self.scheduler.lora_slots.forget(key)
        if self._launched is not None or self.overlap.applies(self.scheduler):
            try:
                return self._step_ahead()
            except BaseException:
                self._launched = None  # its requests are the caller's to fail, as any fault's
                raise
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

    def _step_ahead(self) -> list[RequestOutput]:
        """An overlapped step (engine/overlap.py): draw step t's tokens on the device, plan
        step t+1 with them as placeholders and make its model call, and only then wait for
        step t's tokens and apply them, while step t+1 runs. The outputs are step t's."""
        launched, self._launched = self._launched, None
        if launched is not None:
            self.runner.sample(launched)
        if self.overlap.applies(self.scheduler):
            plan = self.scheduler.schedule(ahead=True)
            if not plan.is_empty:
                self._launched = self.runner.launch(plan, launched)
        if launched is None:
            return []
        if launched.error is not None:
            logger.error("model step over %d requests failed: %s", len(launched.plan.scheduled),
                         launched.error)
        return self._update(launched.plan, self.runner.collect(launched))

    def _update(self, plan: SchedulerOutput, result: RunnerOutput) -> list[RequestOutput]:
        """Fail what failed, append the sampled tokens, let the output processor decide every
        stop, and free what stopped: the one place a request finishes (besides an abort)."""
        outputs = [out for rid, error in result.failed.items()
                   if (out := self.fail_request(rid, error)) is not None]
        for request, tokens, num_proposed in self.scheduler.update_from_output(plan, result):
            rid = request.request_id
            self.speculator.record(rid, num_proposed, len(tokens) - 1)
            reason = None
            try:
                state = self._text_states[rid]
                for sampled in tokens:  # several after a verification; a stop ends them
                    self.scheduler.append_token(request, sampled)
                    reason = stop_reason(request, state)
                    if reason is not None:
                        self.scheduler.finish_request(rid, reason)
                        break
                outputs.append(state.make_output())
            except Exception as exc:  # noqa: BLE001 - e.g. detokenizing: this request only
                outputs.append(self.fail_request(rid, f"{type(exc).__name__}: {exc}"))
                continue
            if reason is not None:
                del self._text_states[rid]
                self.runner.forget(rid)
                self.speculator.forget(rid)
        self.speculator.propose(self.scheduler.running)
        self._publish()
        return outputs

    def stats(self) -> EngineStats:
        """The figures as of the last step: safe to read from any thread."""
        return self.published

    def _stats(self) -> EngineStats:
        s, spec = self.scheduler.stats, self.speculator.stats
        kv = self.kv_manager
        return EngineStats(
            num_running=self.scheduler.num_running, num_waiting=self.scheduler.num_waiting,
            kv_blocks_used=kv.num_blocks - kv.num_free_blocks, kv_blocks_total=kv.num_blocks,
            kv_usage=kv.usage(), prefix_cache_queries=s.prefix_cache_queries,
            prefix_cache_hits=s.prefix_cache_hits, num_preemptions=s.num_preemptions,
            num_prompt_tokens=s.num_prompt_tokens, num_generation_tokens=s.num_generation_tokens,
            last_step_tokens=s.last_step_tokens, memory_pressure=self.scheduler.admission_paused,
            spec_num_drafts=spec.num_drafts, spec_num_draft_tokens=spec.num_draft_tokens,
            spec_num_accepted_tokens=spec.num_accepted_tokens,
            spec_accepted_per_position=tuple(spec.accepted_per_position),
            **self._lora_stats())

    def _lora_stats(self) -> dict:
        slots = self.scheduler.lora_slots
        if slots is None:
            return {}
        return {"lora_running": {key.rpartition("@")[0]: n for key, n in slots.in_use().items()},
                "lora_requests": dict(self.loras.requests_served),
                "lora_slot_loads": slots.num_loads}

