"""Prometheus metrics under vLLM's names with a `pagedllm:` prefix.

Engine counters are read from EngineStats at scrape time (a custom collector), so the
engine thread never touches prometheus objects; request latencies are observed by the
HTTP handlers as histograms.
"""
from __future__ import annotations

import collections
import threading
import time

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

P = "pagedllm:"
RECENT_SECONDS = 60.0  # the page's latency charts look at the last minute
RECENT_MAX = 4096
_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                    40.0, 80.0, 160.0)
_TPOT_BUCKETS = (0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5)


class EngineStatsCollector:
    def __init__(self, engine, model_name: str):
        self.engine = engine
        self.labels = {"model_name": model_name}

    def _gauge(self, name, doc, value):
        g = GaugeMetricFamily(P + name, doc, labels=list(self.labels))
        g.add_metric(list(self.labels.values()), value)
        return g

    def _counter(self, name, doc, value):
        c = CounterMetricFamily(P + name, doc, labels=list(self.labels))
        c.add_metric(list(self.labels.values()), value)
        return c

    def collect(self):
        s = self.engine.stats()
        yield self._gauge("num_requests_running", "Requests in the running batch.", s.num_running)
        yield self._gauge("num_requests_waiting", "Requests waiting to be scheduled.", s.num_waiting)
        yield self._gauge("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1).", s.kv_usage)
        yield self._gauge("num_kv_blocks", "KV-cache blocks in the pool.", s.kv_blocks_total)
        yield self._gauge("memory_pressure", "1 while new requests wait for memory (--max-memory).",
                          float(s.memory_pressure))
        yield self._counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                            s.prefix_cache_queries)
        yield self._counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                            s.prefix_cache_hits)
        yield self._counter("num_preemptions", "Requests preempted (recompute).", s.num_preemptions)
        yield self._counter("prompt_tokens", "Prompt tokens of admitted requests.", s.num_prompt_tokens)
        yield self._counter("generation_tokens", "Generated tokens.", s.num_generation_tokens)
        by_user = GaugeMetricFamily(P + "num_requests_waiting_by_user", "Waiting requests per user.",
                                    labels=["model_name", "user"])
        for user, count in self.engine.waiting_by_user().items():
            by_user.add_metric([self.labels["model_name"], user], count)
        yield by_user
        # As vLLM's cache_config_info: the pool's settings as labels, for dashboards that
        # divide usage by capacity or tell an int8 cache from a full-precision one.
        cache = self.engine.cache_config
        info = GaugeMetricFamily(P + "cache_config_info", "KV-cache configuration (labels; value 1).",
                                 labels=["model_name", "block_size", "cache_dtype", "num_blocks",
                                         "enable_prefix_caching"])
        info.add_metric([self.labels["model_name"], str(cache.block_size), cache.cache_dtype,
                         str(cache.num_blocks), str(cache.enable_prefix_caching)], 1)
        yield info
        cpu = self.engine.cpu
        cpu_info = GaugeMetricFamily(P + "cpu_info", "CPU kernel level in use (labels; value 1).",
                                     labels=["model_name", "isa", "best_isa", "machine"])
        cpu_info.add_metric([self.labels["model_name"], cpu.level, cpu.best, cpu.machine], 1)
        yield cpu_info


class ServerMetrics:
    def __init__(self, engine, model_name: str):
        self.registry = CollectorRegistry()
        self.registry.register(EngineStatsCollector(engine, model_name))
        # (finish time, ttft s, tpot s) of recent requests, for recent_latencies().
        self._recent: collections.deque = collections.deque(maxlen=RECENT_MAX)
        self._recent_lock = threading.Lock()
        labels = ["model_name"]
        self.model_name = model_name
        self.ttft = Histogram(P + "time_to_first_token_seconds", "Time to first token.", labels,
                              registry=self.registry, buckets=_LATENCY_BUCKETS)
        self.tpot = Histogram(P + "time_per_output_token_seconds",
                              "Mean time per output token after the first.", labels,
                              registry=self.registry, buckets=_TPOT_BUCKETS)
        self.e2e = Histogram(P + "e2e_request_latency_seconds", "End-to-end request latency.", labels,
                             registry=self.registry, buckets=_LATENCY_BUCKETS)
        self.queue = Histogram(P + "request_queue_time_seconds", "Time waiting before first scheduled.",
                               labels, registry=self.registry, buckets=_LATENCY_BUCKETS)
        self.success = Counter(P + "request_success", "Finished requests by reason.",
                               labels + ["finished_reason"], registry=self.registry)
        self.user_requests = Counter(P + "user_requests", "Finished requests per user (API key).",
                                     ["user"], registry=self.registry)
        self.user_prompt_tokens = Counter(P + "user_prompt_tokens", "Prompt tokens per user.",
                                          ["user"], registry=self.registry)
        self.user_completion_tokens = Counter(P + "user_completion_tokens",
                                              "Completion tokens per user.", ["user"],
                                              registry=self.registry)

    def recent_latencies(self) -> dict:
        """TTFT and TPOT p50/p95 in ms over the requests that finished in the last minute
        (the page's charts; the histograms above are for Prometheus)."""
        horizon = time.monotonic() - RECENT_SECONDS
        with self._recent_lock:
            while self._recent and self._recent[0][0] < horizon:
                self._recent.popleft()
            rows = list(self._recent)

        def percentiles(values):
            values = sorted(v * 1000 for v in values if v is not None)
            if not values:
                return {"p50": None, "p95": None}
            pick = lambda q: values[min(len(values) - 1, int(q * len(values)))]  # noqa: E731
            return {"p50": round(pick(0.5), 1), "p95": round(pick(0.95), 1)}

        return {"ttft_ms": percentiles(r[1] for r in rows), "tpot_ms": percentiles(r[2] for r in rows)}

    def observe_user(self, user: str, prompt_tokens: int, completion_tokens: int) -> None:
        self.user_requests.labels(user).inc()
        self.user_prompt_tokens.labels(user).inc(prompt_tokens)
        self.user_completion_tokens.labels(user).inc(completion_tokens)

    def observe_request(self, *, ttft: float | None, e2e: float, num_output_tokens: int,
                        queue_time: float | None, finish_reason: str | None) -> None:
        label = self.model_name
        tpot = None if ttft is None or num_output_tokens < 2 else (e2e - ttft) / (num_output_tokens - 1)
        with self._recent_lock:
            self._recent.append((time.monotonic(), ttft, tpot))
        if ttft is not None:
            self.ttft.labels(label).observe(ttft)
            if num_output_tokens > 1:
                self.tpot.labels(label).observe((e2e - ttft) / (num_output_tokens - 1))
        self.e2e.labels(label).observe(e2e)
        if queue_time is not None:
            self.queue.labels(label).observe(queue_time)
        self.success.labels(label, finish_reason or "abort").inc()
