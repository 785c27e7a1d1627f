"""Prometheus metrics under vLLM's names with a `pagedllm:` prefix.

Engine counters are read at scrape time (a custom collector) from the figures the engines
last published (EngineClient.figures(): plain records), so neither thread touches the
other's objects; request latencies are observed by the HTTP handlers as histograms.
"""
from __future__ import annotations

import collections
import hashlib
import threading
import time

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

P = "pagedllm:"
# Per-user series are bounded: a `user` field or client address is a label only as a short
# form (hashed past USER_LABEL_CHARS), the first MAX_USER_LABELS of them get series of their
# own and the rest count as "other"; API key names (bounded by the key file) always do. The
# waiting-per-user gauge shows the MAX_WAITING_LABELS users with most waiting, plus "other".
USER_LABEL_CHARS = 48
MAX_USER_LABELS = 64
MAX_WAITING_LABELS = 16
OTHER_USERS = "other"


def user_label(user: str) -> str:
    """A user as a metric label: key names as they are; a long `user:`/`addr:` value hashed."""
    if len(user) <= USER_LABEL_CHARS:
        return user
    kind = user.split(":", 1)[0] if ":" in user[:8] else "user"
    return f"{kind}:sha256-{hashlib.sha256(user.encode('utf-8', 'replace')).hexdigest()[:16]}"


def waiting_labels(waiting: dict[str, int]) -> list[tuple[str, int]]:
    """The users with most waiting, as labels, and the rest summed as "other"."""
    busiest = sorted(waiting.items(), key=lambda item: -item[1])
    shown = [(user_label(user), n) for user, n in busiest[:MAX_WAITING_LABELS]]
    rest = sum(n for _, n in busiest[MAX_WAITING_LABELS:])
    return shown + ([(OTHER_USERS, rest)] if rest else [])
RECENT_SECONDS = 60.0  # the page's latency charts look at the last minute
RECENT_MAX = 4096
_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                    40.0, 80.0, 160.0)
_TPOT_BUCKETS = (0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5)


class EngineStatsCollector:
    """Engine figures at scrape time from `figures()`: one sample per engine, labelled by
    model_name (the row's own in a model store) plus `label_names` (("replica",) when
    replicas serve)."""

    def __init__(self, figures, model_name: str, label_names: tuple[str, ...] = ()):
        self.figures = figures
        self.model_name = model_name
        self.label_names = ["model_name", *label_names]

    def _family(self, kind, name, doc, rows, value, extra=()):
        family = kind(P + name, doc, labels=self.label_names + list(extra))
        for row in rows:
            for labels, v in value(row):
                family.add_metric([row.model or self.model_name, *row.labels, *labels], v)
        return family

    def collect(self):
        rows = self.figures()
        one = lambda get: lambda row: [((), get(row.stats))]  # noqa: E731
        for name, doc, get in _GAUGES:
            yield self._family(GaugeMetricFamily, name, doc, rows, one(get))
        # vLLM's name for the same usage where the pool is on a GPU (its V0 dashboards).
        on_gpu = [row for row in rows if row.device == "cuda"]
        if on_gpu:
            yield self._family(GaugeMetricFamily, "gpu_cache_usage_perc",
                               "Fraction of the GPU's KV-cache blocks in use (0-1).", on_gpu,
                               one(lambda stats: stats.kv_usage))
        for name, doc, get in _COUNTERS:
            yield self._family(CounterMetricFamily, name, doc, rows, one(get))
        yield self._family(CounterMetricFamily, "spec_decode_num_accepted_tokens_per_pos",
                           "Proposed tokens accepted, by their position in the proposal.", rows,
                           lambda row: [((str(i),), n) for i, n in
                                        enumerate(row.stats.spec_accepted_per_position)],
                           ["position"])
        yield self._family(GaugeMetricFamily, "lora_requests_running",
                           "Running requests per LoRA adapter.", rows,
                           lambda row: [((name,), n) for name, n in
                                        row.stats.lora_running.items()], ["adapter"])
        yield self._family(CounterMetricFamily, "lora_requests",
                           "Requests admitted per LoRA adapter since start.", rows,
                           lambda row: [((name,), n) for name, n in
                                        row.stats.lora_requests.items()], ["adapter"])
        yield self._family(CounterMetricFamily, "lora_slot_loads",
                           "LoRA adapters copied into a slot (--max-loras).", rows,
                           one(lambda stats: stats.lora_slot_loads))
        yield self._family(GaugeMetricFamily, "num_requests_waiting_by_user",
                           "Waiting requests per user.", rows,
                           lambda row: [((user,), n) for user, n in
                                        waiting_labels(row.waiting_by_user)],
                           ["user"])
        # As vLLM's cache_config_info: the pool's settings as labels, for dashboards that
        # divide usage by capacity or tell an int8 cache from a full-precision one.
        yield self._family(GaugeMetricFamily, "cache_config_info",
                           "KV-cache configuration (labels; value 1).", rows,
                           lambda row: [((str(row.cache.block_size), row.cache.cache_dtype,
                                          str(row.cache.num_blocks),
                                          str(row.cache.enable_prefix_caching)), 1)],
                           ["block_size", "cache_dtype", "num_blocks", "enable_prefix_caching"])
        if any(row.pid is not None for row in rows):
            yield self._family(GaugeMetricFamily, "replica_info",
                               "An engine replica's process, Ray node and host (labels; value 1).",
                               rows, lambda row: [((str(row.pid), row.node, row.host), 1)],
                               ["pid", "node", "host"])
        yield self._family(GaugeMetricFamily, "device_info",
                           "Where the engine's model runs (--device; labels; value 1).", rows,
                           lambda row: [((row.device,), 1)], ["device"])
        yield self._family(GaugeMetricFamily, "cpu_info",
                           "CPU kernel level in use (labels; value 1).", rows,
                           lambda row: [((row.cpu.level, row.cpu.best, row.cpu.machine,
                                          str(row.cpu.amx).lower(), str(row.cpu.int16).lower()), 1)],
                           ["isa", "best_isa", "machine", "amx", "int16"])


_GAUGES = (
    ("num_requests_running", "Requests in the running batch.", lambda s: s.num_running),
    ("num_requests_waiting", "Requests waiting to be scheduled.", lambda s: s.num_waiting),
    ("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1).", lambda s: s.kv_usage),
    ("num_kv_blocks", "KV-cache blocks in the pool.", lambda s: s.kv_blocks_total),
    ("memory_pressure", "1 while new requests wait for memory (--max-memory).",
     lambda s: float(s.memory_pressure)),
)
_COUNTERS = (
    ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
     lambda s: s.prefix_cache_queries),
    ("prefix_cache_hits", "Prompt tokens found in the prefix cache.",
     lambda s: s.prefix_cache_hits),
    ("num_preemptions", "Requests preempted (recompute).", lambda s: s.num_preemptions),
    ("prompt_tokens", "Prompt tokens of admitted requests.", lambda s: s.num_prompt_tokens),
    ("generation_tokens", "Generated tokens.", lambda s: s.num_generation_tokens),
    # Speculative decoding, under vLLM's names (--speculative; core/speculation.py).
    ("spec_decode_num_drafts", "Verification steps that checked proposed tokens.",
     lambda s: s.spec_num_drafts),
    ("spec_decode_num_draft_tokens", "Proposed tokens verified.", lambda s: s.spec_num_draft_tokens),
    ("spec_decode_num_accepted_tokens", "Proposed tokens accepted.",
     lambda s: s.spec_num_accepted_tokens),
)


class ServerMetrics:
    def describe_start(self, command: str) -> None:
        """How the server was started, for `pagedllm bench`'s recommended command."""
        from prometheus_client import Gauge

        Gauge(P + "serve_command_info", "The `pagedllm serve` command this server runs "
              "(label; value 1).", ["command"], registry=self.registry).labels(command).set(1)

    def __init__(self, figures, model_name: str, label_names: tuple[str, ...] = ()):
        """figures: a callable giving every engine's published EngineFigures."""
        self.registry = CollectorRegistry()
        self.registry.register(EngineStatsCollector(figures, model_name, label_names))
        # (finish time, ttft s, tpot s) of recent requests, for recent_latencies().
        self._recent: collections.deque = collections.deque(maxlen=RECENT_MAX)
        self._recent_lock = threading.Lock()
        self._user_labels: set[str] = set()  # the users (not keys) with series of their own
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
        self.api_requests = Counter(P + "api_requests", "Accepted generation requests by the "
                                    "API they came through (openai.chat, anthropic.messages, ...).",
                                    labels + ["api"], registry=self.registry)
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

    def observe_user(self, user: str, prompt_tokens: int, completion_tokens: int,
                     is_key: bool = False) -> None:
        label = self._user_series(user, is_key)
        self.user_requests.labels(label).inc()
        self.user_prompt_tokens.labels(label).inc(prompt_tokens)
        self.user_completion_tokens.labels(label).inc(completion_tokens)

    def _user_series(self, user: str, is_key: bool) -> str:
        """The label a user's counts go under (bounded: USER_LABEL_CHARS, MAX_USER_LABELS)."""
        if is_key:
            return user
        label = user_label(user)
        with self._recent_lock:
            if label in self._user_labels or len(self._user_labels) < MAX_USER_LABELS:
                self._user_labels.add(label)
                return label
        return OTHER_USERS

    def observe_request(self, *, ttft: float | None, e2e: float, num_output_tokens: int,
                        queue_time: float | None, finish_reason: str | None,
                        model: str | None = None) -> None:
        label = model or self.model_name
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


class EmbeddingCollector:
    """The embedding model's counters (embeddings/service.py's figures) at scrape time."""

    FIGURES = (("embedding_requests", "Embedding requests answered.", "requests"),
               ("embedding_inputs", "Inputs embedded (texts or token lists).", "inputs"),
               ("embedding_prompt_tokens", "Tokens of the inputs embedded.", "tokens"),
               ("embedding_batches", "Forward passes of the embedding model (requests that "
                                     "queued together share one).", "batches"))

    def __init__(self, service):
        self.service = service

    def collect(self):
        figures = self.service.figures
        for name, doc, attribute in self.FIGURES:
            family = CounterMetricFamily(P + name, doc, labels=["model_name"])
            family.add_metric([self.service.name], getattr(figures, attribute))
            yield family


class ModelPoolCollector:
    """A model store's loads and unloads (serving/model_pool.py's events) at scrape time."""

    def __init__(self, pool):
        self.pool = pool

    def collect(self):
        events, loaded = self.pool.events, self.pool.loaded()
        resident = GaugeMetricFamily(P + "models_loaded", "Models loaded now (a store).")
        resident.add_metric([], len(loaded))
        yield resident
        size = GaugeMetricFamily(P + "model_resident_bytes",
                                 "A loaded model's weights and KV cache (bytes).",
                                 labels=["model_name"])
        for model in loaded:
            size.add_metric([model.name], model.size_bytes)
        yield size
        loads = CounterMetricFamily(P + "model_loads", "Models loaded on demand.",
                                    labels=["model_name"])
        for name, count in list(events.loads.items()):
            loads.add_metric([name], count)
        yield loads
        unloads = CounterMetricFamily(P + "model_unloads", "Models unloaded, by why (expired: "
                                      "keep_alive ran out; room: another model needed it; "
                                      "failed; shutdown).", labels=["model_name", "reason"])
        for (name, reason), count in list(events.unloads.items()):
            unloads.add_metric([name, reason], count)
        yield unloads
        seconds = GaugeMetricFamily(P + "model_load_seconds", "The last load's duration.",
                                    labels=["model_name"])
        for name, value in list(events.load_seconds.items()):
            seconds.add_metric([name], value)
        yield seconds
        refused = CounterMetricFamily(P + "model_busy_refusals", "Requests refused (503) "
                                      "because every model that could make room was busy.")
        refused.add_metric([], events.refusals)
        yield refused
