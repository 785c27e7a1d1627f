"""`pagedllm bench`: closed-loop load at N = 1, 2, 4, 8... concurrent streams against any
OpenAI-compatible server, watching memory, then recommending the highest N that meets the
latency targets. Statistics, table, JSON and plot are in bench_report.py.
"""
from __future__ import annotations

import asyncio
import json
import random
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from urllib.parse import urlparse

import httpx

from pagedllm.tools.text_prompts import grounded_prompt_token_ids, make_prompt_token_ids


@dataclass
class RequestRecord:
    prompt_tokens: int
    output_tokens: int = 0
    ttft: float | None = None  # seconds
    e2e: float = 0.0
    itls: list[float] = field(default_factory=list)  # gaps between streamed chunks
    error: str | None = None


@dataclass
class MemoryPeaks:
    kv_usage: float | None = None
    server_rss_bytes: int | None = None
    gpu_memory_mib: float | None = None


def make_prompts(tokenizer, num: int, lengths: tuple[int, int], shared_prefix: int,
                 seed: int, load: str = "plain") -> list[tuple[str, int]]:
    """(text, approximate token count) pairs of real text, distinct unless a prefix is shared.
    load "grounded": each asks for a passage of it to be repeated (text_prompts.py)."""
    rng = random.Random(seed)
    wanted = [rng.randint(*lengths) for _ in range(num)]
    if load == "grounded":
        prompts = grounded_prompt_token_ids(tokenizer, wanted, seed=seed)
        return [(tokenizer.decode(p, skip_special_tokens=False), len(p)) for p in prompts]
    prompts = make_prompt_token_ids(tokenizer, wanted, seed=seed, shared_prefix_tokens=shared_prefix)
    return [(tokenizer.decode(p), len(p)) for p in prompts]


SPEC_COUNTERS = {"pagedllm:spec_decode_num_drafts_total": "drafts",
                 "pagedllm:spec_decode_num_draft_tokens_total": "draft_tokens",
                 "pagedllm:spec_decode_num_accepted_tokens_total": "accepted_tokens"}


def spec_counters(base_url: str, headers: dict) -> dict[str, float]:
    """The server's speculative-decoding counters, summed over its engines ({} if none)."""
    from prometheus_client.parser import text_string_to_metric_families

    totals: dict[str, float] = {}
    try:
        text = httpx.get(base_url + "/metrics", headers=headers, timeout=30, verify=False).text
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                name = SPEC_COUNTERS.get(sample.name)
                if name is not None:
                    totals[name] = totals.get(name, 0.0) + sample.value
    except Exception:  # noqa: BLE001 - another server, or no /metrics access
        return {}
    return totals


def spec_during(before: dict[str, float], after: dict[str, float]) -> dict | None:
    """What a level's requests proposed and had accepted; None if nothing was proposed."""
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    if not delta.get("draft_tokens"):
        return None
    return {**{k: int(v) for k, v in delta.items()},
            "acceptance_rate": round(delta["accepted_tokens"] / delta["draft_tokens"], 4),
            "tokens_per_verification": round(1 + delta["accepted_tokens"] / delta["drafts"], 3)}


async def stream_completion(client: httpx.AsyncClient, model: str, prompt: str, num_prompt: int,
                            max_tokens: int, headers: dict, on_chunk=None) -> RequestRecord:
    record = RequestRecord(prompt_tokens=num_prompt)
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    start = last = time.perf_counter()
    chunks = 0
    try:
        async with client.stream("POST", "/v1/completions", json=body, headers=headers) as r:
            if r.status_code != 200:
                record.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return record
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                if data.get("usage"):
                    record.output_tokens = data["usage"].get("completion_tokens", 0)
                    record.prompt_tokens = data["usage"].get("prompt_tokens", num_prompt)
                if not data.get("choices") or not data["choices"][0].get("text"):
                    continue
                now = time.perf_counter()
                if record.ttft is None:
                    record.ttft = now - start
                else:
                    record.itls.append(now - last)
                last = now
                chunks += 1
                if on_chunk is not None:
                    on_chunk()
    except httpx.HTTPError as exc:
        record.error = f"{type(exc).__name__}: {exc}"
    record.e2e = time.perf_counter() - start
    if not record.output_tokens:
        record.output_tokens = chunks  # servers without usage in streams: one token a chunk
    return record


def find_server_process(base_url: str):
    """The local process listening on the server's port, if any (for its memory)."""
    import psutil

    parsed = urlparse(base_url)
    if parsed.hostname not in ("127.0.0.1", "localhost", "::1"):
        return None
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    try:
        for conn in psutil.net_connections(kind="tcp"):
            if conn.status == psutil.CONN_LISTEN and conn.laddr.port == port and conn.pid:
                return psutil.Process(conn.pid)
    except (psutil.AccessDenied, PermissionError):
        return None
    return None


def _gpu_memory_mib() -> float | None:
    if not shutil.which("nvidia-smi"):
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=5).stdout
        return sum(float(v) for v in out.split())
    except (OSError, ValueError, subprocess.SubprocessError):
        return None


_KV_METRICS = ("pagedllm:kv_cache_usage_perc", "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")


async def watch_memory(client: httpx.AsyncClient, process, peaks: MemoryPeaks, headers: dict,
                       stop: asyncio.Event, interval: float = 0.5) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    while not stop.is_set():
        try:
            text = (await client.get("/metrics", headers=headers)).text
            for family in text_string_to_metric_families(text):
                for sample in family.samples:
                    if sample.name in _KV_METRICS:
                        peaks.kv_usage = max(peaks.kv_usage or 0.0, sample.value)
        except Exception:  # noqa: BLE001 - a server without /metrics is fine
            pass
        if process is not None:
            try:
                rss = process.memory_info().rss + sum(c.memory_info().rss for c in process.children(True))
                peaks.server_rss_bytes = max(peaks.server_rss_bytes or 0, rss)
            except Exception:  # noqa: BLE001 - the process may be gone
                pass
        gpu = _gpu_memory_mib()
        if gpu is not None:
            peaks.gpu_memory_mib = max(peaks.gpu_memory_mib or 0.0, gpu)
        try:
            await asyncio.wait_for(stop.wait(), interval)
        except asyncio.TimeoutError:
            pass


PROGRESS_EVERY_S = 5.0


async def run_level(base_url: str, model: str, concurrency: int, prompts: list[tuple[str, int]],
                    max_tokens: int, headers: dict, on_done=None, progress=None):
    """Closed loop: `concurrency` workers, each sending its next request when the last ends.
    progress: told of each streamed chunk (.chunk()), each finished request (.done(record))
    and every PROGRESS_EVERY_S seconds (.tick()), so a long level says how it goes."""
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(600.0), limits=limits,
                                 verify=False) as client:
        todo = list(prompts)
        records: list[RequestRecord] = []
        peaks = MemoryPeaks()
        stop = asyncio.Event()
        watcher = asyncio.create_task(watch_memory(client, find_server_process(base_url), peaks,
                                                   headers, stop))

        async def worker():
            while todo:
                text, num = todo.pop(0)
                record = await stream_completion(client, model, text, num, max_tokens, headers,
                                                 progress.chunk if progress else None)
                records.append(record)
                if on_done:
                    on_done()
                if progress is not None:
                    progress.done(record)

        async def ticker():
            while True:
                await asyncio.sleep(PROGRESS_EVERY_S)
                progress.tick()

        start = time.perf_counter()
        ticking = asyncio.create_task(ticker()) if progress is not None else None
        try:
            await asyncio.gather(*(worker() for _ in range(concurrency)))
        finally:
            if ticking is not None:
                ticking.cancel()
        duration = time.perf_counter() - start
        stop.set()
        await watcher
    return records, duration, peaks


def server_settings(base_url: str, headers: dict) -> dict:
    """What the server says of its setup (its /metrics info gauges and /v1/models), for the
    report: KV pool, block size, CPU level; empty where it does not say."""
    from prometheus_client.parser import text_string_to_metric_families

    settings: dict = {}
    try:
        models = httpx.get(base_url + "/v1/models", headers=headers, timeout=30, verify=False).json()
        settings["max_model_len"] = models["data"][0].get("max_model_len")
        text = httpx.get(base_url + "/metrics", headers=headers, timeout=30, verify=False).text
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == "pagedllm:cache_config_info":
                    settings.update({k: sample.labels[k] for k in
                                     ("block_size", "cache_dtype", "num_blocks") if k in sample.labels})
                elif sample.name == "pagedllm:cpu_info":
                    settings["cpu_isa"] = sample.labels.get("isa")
                    if sample.labels.get("amx") == "true":
                        settings["cpu_isa"] += "+amx"
                elif sample.name == "pagedllm:device_info":
                    settings["device"] = sample.labels.get("device")
                elif sample.name == "pagedllm:serve_command_info":
                    settings["command"] = sample.labels.get("command")
    except Exception:  # noqa: BLE001 - another server, or no /metrics access: report less
        pass
    if settings.get("device") == "cuda" and find_server_process(base_url) is not None:
        settings["gpu"] = gpu_name()  # the server runs here: the card is this machine's
    return settings


def gpu_name() -> str | None:
    """This machine's first GPU as "NAME, N GiB" (nvidia-smi), or None."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True,
                             timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    first = out.stdout.strip().splitlines()[:1]
    if out.returncode != 0 or not first or "," not in first[0]:
        return None
    name, mib = first[0].rsplit(",", 1)
    return f"{name.strip()}, {float(mib) / 1024:.0f} GiB"


def host_busy_percent(seconds: float = 1.0) -> float:
    """How much of this machine's CPU is in use right now (0-100), measured between levels
    while the server is idle: anything high means other work skews the figures."""
    import psutil

    return float(psutil.cpu_percent(interval=seconds))


async def warm_up(base_url: str, model: str, count: int, headers: dict) -> None:
    """A few short requests before measuring, so first-use costs (page faults in the weights
    and the KV pool, allocator growth) do not land on the first level."""
    async with httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(600.0), verify=False) as client:
        for _ in range(count):
            await stream_completion(client, model, "Warm-up: count from one to ten.", 8, 8, headers)


def served_model(base_url: str, headers: dict) -> str:
    r = httpx.get(base_url + "/v1/models", headers=headers, timeout=30, verify=False)
    r.raise_for_status()
    return r.json()["data"][0]["id"]
