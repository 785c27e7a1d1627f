"""GET /v1/server/state: what the server is doing now, for the page's live view and for
scripts: the engine's snapshot (every KV block, running and waiting requests, fair share),
counters, recent latencies, memory; the configuration and what more parallel slots cost.

The engine snapshot is taken on the engine thread between steps (one command, like an
abort), only when someone asks; the streamed form sends one at most twice a second and
waits for the client to take it before making the next, so a slow browser holds one
snapshot, never a backlog.
"""
from __future__ import annotations

import asyncio
import json
import os
import time

import psutil

from pagedllm.core import sizing
from pagedllm.core.snapshot import sum_stats
from pagedllm.server.errors import APIError
from pagedllm.server.state import ServerState

STREAM_INTERVAL_S = 0.5
PLAN_PARALLEL = (1, 2, 4, 8, 16, 32, 64)


class LiveView:
    def __init__(self, state: ServerState, bench_results: str | None = None):
        self.state = state
        self.bench_results = bench_results
        self._process = psutil.Process()
        self._configs: dict[tuple, dict] = {}

    async def snapshot(self, replica: str | None = None) -> dict:
        """With replicas: `replica`'s picture (the first one's by default), under `replicas`
        a line for each (id, host, pool use, running, waiting); counters for them all. In a
        model store the loaded models take the replicas' place (`replica` names one;
        `models` lists the store, loaded or not)."""
        figures = self.state.client.figures()
        replicas = [f for f in figures if f.labels or f.model]
        key = lambda f: f.labels[0] if f.labels else f.model  # noqa: E731
        if replicas and replica is None:
            replica = key(replicas[0])
        if self.state.pool is not None and not replicas:  # nothing loaded yet
            data = {"time": time.time(), "block_size": 0, "blocks": "", "block_hashed": "",
                    "block_refs": {}, "requests": [], "fair_share": []}
        else:
            try:
                data = (await self.state.client.snapshot(replica)).to_json()
            except LookupError as exc:  # a store's model unloaded meanwhile
                raise APIError(404, str(exc), "replica", "not_found") from exc
        # Read again: the snapshot waited for the step in flight, and the figures must be those
        # of the same moment (a long prefill step lies between the two reads otherwise).
        figures = self.state.client.figures()
        replicas = [f for f in figures if f.labels or f.model]
        stats = sum_stats([f.stats for f in figures])
        if replicas:
            data["replica"] = replica
            data["replicas"] = [{"replica": key(f), "host": f.host, "node": f.node,
                                 "kv_usage": f.stats.kv_usage, "kv_blocks_total": f.stats.kv_blocks_total,
                                 "num_running": f.stats.num_running, "num_waiting": f.stats.num_waiting}
                                for f in replicas]
        if self.state.pool is not None:
            data["models"] = self.models()
        loras = self.state.client.loras
        if loras is not None:  # the adapters, and how many requests each serves
            data["adapters"] = [{"name": a.name, "format": a.source, "rank": a.rank,
                                 "path": a.path, "running": stats.lora_running.get(a.name, 0),
                                 "requests": stats.lora_requests.get(a.name, 0)}
                                for a in loras.adapters()]
        now = time.monotonic()
        for view in data["requests"]:
            choice = self.state.live_choices.get(view["request_id"])
            first = choice.first_token_time if choice is not None else None
            view["ttft_ms"] = None if first is None else round((first - choice.arrival) * 1000)
            view["tokens_per_s"] = (round(view["num_output_tokens"] / (now - first), 1)
                                    if first is not None and now > first else None)
        data["stats"] = {
            "num_running": stats.num_running, "num_waiting": stats.num_waiting,
            "kv_blocks_used": stats.kv_blocks_used, "kv_blocks_total": stats.kv_blocks_total,
            "kv_usage": stats.kv_usage, "prefix_cache_queries": stats.prefix_cache_queries,
            "prefix_cache_hits": stats.prefix_cache_hits, "num_preemptions": stats.num_preemptions,
            "num_prompt_tokens": stats.num_prompt_tokens,
            "num_generation_tokens": stats.num_generation_tokens,
            "memory_pressure": stats.memory_pressure,
            "spec_num_drafts": stats.spec_num_drafts,
            "spec_num_draft_tokens": stats.spec_num_draft_tokens,
            "spec_num_accepted_tokens": stats.spec_num_accepted_tokens}
        data["latency"] = self.state.metrics.recent_latencies()
        data["memory"] = {"rss_bytes": self._process.memory_info().rss}
        return data

    async def stream(self, replica: str | None = None):
        """Server-sent events: a snapshot every STREAM_INTERVAL_S while the client reads."""
        while not self.state.draining:
            started = time.monotonic()
            try:
                yield f"data: {json.dumps(await self.snapshot(replica))}\n\n"
            except APIError:  # that replica is gone (Serve replaced it): show the first
                replica = None
            await asyncio.sleep(max(0.0, STREAM_INTERVAL_S - (time.monotonic() - started)))

    def models(self) -> list[dict]:
        """A store's models: loaded or not, resident size, seconds until unloaded, loads."""
        pool = self.state.pool
        loaded = {m.name: m for m in pool.loaded()}
        now = time.monotonic()
        rows = []
        for name in pool.catalog.names:
            model = loaded.get(name)
            expires = model.expires_in(now) if model is not None else None
            rows.append({"model": name, "kind": pool.catalog.entries[name].kind,
                         "loaded": model is not None,
                         "size_bytes": model.size_bytes if model is not None else None,
                         "expires_in_s": None if expires in (None, float("inf")) else round(expires),
                         "busy": model.busy if model is not None else False,
                         "loads": pool.events.loads[name],
                         "load_seconds": pool.events.load_seconds.get(name)})
        return rows

    def info(self, replica: str | None = None):
        """The EngineInfo shown: the server's; in a store the picked loaded model's (default:
        the most recently used), None while nothing is loaded."""
        chosen = self._chosen(replica)
        return None if chosen is None else chosen[0]

    def config(self, replica: str | None = None) -> dict | None:
        """What the server (in a store: the picked loaded model) runs with."""
        chosen = self._chosen(replica)
        if chosen is None:
            return None
        info, name = chosen
        key = (name, info.model_path)
        if key not in self._configs:  # read once per model: the quantization is in the file
            self._configs[key] = self._config(info, name)
        return self._configs[key]

    def _chosen(self, replica: str | None):
        if self.state.pool is None:
            return self.state.client.info, self.state.served_model_name
        loaded = sorted((m for m in self.state.pool.loaded() if m.kind == "chat"),
                        key=lambda m: -m.last_used)
        chosen = next((m for m in loaded if m.name == replica), loaded[0] if loaded else None)
        return None if chosen is None else (chosen.client.info, chosen.name)

    def _config(self, info, name: str) -> dict:
        from pagedllm.weights.inspect import summarize_checkpoint

        cache, scheduler = info.cache_config, info.scheduler_config
        summary = summarize_checkpoint(info.model_path)
        cpu = info.cpu
        return {
            "model": name, "architecture": info.model_config.architecture,
            "quantization": summary.file_type or info.dtype, "dtype": info.dtype,
            "kv_cache_dtype": cache.cache_dtype, "kv_cache_bytes": info.kv_memory_bytes,
            "num_blocks": cache.num_blocks, "block_size": cache.block_size,
            "prefix_caching": cache.enable_prefix_caching,
            "max_num_seqs": scheduler.max_num_seqs, "max_model_len": scheduler.max_model_len,
            "cpu_isa": cpu.level, "cpu_amx": cpu.amx, "cpu_best_isa": cpu.best, "threads": info.num_threads,
            "keys": self.state.keys.enabled}

    def plan(self, info) -> list[dict]:
        """KV memory for N parallel requests at the full context and at a typical length,
        with this server's (a model's) bytes per token: what raising --max-num-seqs would
        cost, and whether each fits in its pool."""
        cache = info.cache_config
        per_token = sizing.kv_bytes_per_token(info.model_config, sizing.ELEMENT_SIZES[info.dtype],
                                              cache.cache_dtype)
        full = sizing.blocks_for_tokens(info.max_model_len, cache.block_size)
        typical_len = min(info.max_model_len, sizing.AUTO_TYPICAL_REQUEST_TOKENS)
        typical = sizing.blocks_for_tokens(typical_len, cache.block_size)
        return [{"parallel": n, "full_context_bytes": n * full * cache.block_size * per_token,
                 "typical_bytes": n * typical * cache.block_size * per_token,
                 "typical_tokens": typical_len,
                 "full_context_fits": n * full <= cache.num_blocks,
                 "fits": n * typical <= cache.num_blocks} for n in PLAN_PARALLEL]

    def bench(self) -> dict | None:
        """The newest bench.json under --bench-results, if any."""
        if not self.bench_results:
            return None
        newest = None
        for folder, _, files in os.walk(self.bench_results):
            if "bench.json" in files:
                path = os.path.join(folder, "bench.json")
                if newest is None or os.path.getmtime(path) > os.path.getmtime(newest):
                    newest = path
        if newest is None:
            return None
        try:
            with open(newest, encoding="utf-8") as f:
                data = json.load(f)
        except (OSError, ValueError):
            return None
        data["path"] = newest
        return data
