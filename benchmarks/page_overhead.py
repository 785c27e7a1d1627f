"""What the page's live view costs the engine: decode-heavy load with the state stream read
(as the open page does, a snapshot every 0.5 s) against without, alternated in one run.

    .venv/bin/python benchmarks/page_overhead.py [--rounds 8] [--concurrency 4] [--max-tokens 256]

Prints what one engine snapshot of a large pool costs the engine thread, then output
tokens/s for each round of each variant, the medians and their ratio.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import os
import statistics
import sys
import threading
import time

import httpx

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from server_process import ServerProcess  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import add_smoke  # noqa: E402


def load(url: str, concurrency: int, max_tokens: int) -> float:
    """`concurrency` requests of max_tokens each, at once; output tokens/s."""
    def one(i):
        r = httpx.post(url + "/v1/completions", timeout=600,
                       json={"prompt": f"Request {i}: tell a story.", "max_tokens": max_tokens,
                             "ignore_eos": True, "temperature": 0})
        return r.json()["usage"]["completion_tokens"]

    started = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        tokens = sum(pool.map(one, range(concurrency)))
    return tokens / (time.perf_counter() - started)


def watch(url: str, stop: threading.Event, seen: list) -> None:
    with httpx.stream("GET", url + "/v1/server/state?stream=true", timeout=600) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                seen.append(len(line))
            if stop.is_set():
                return


def snapshot_cost(num_blocks: int = 16384, block_size: int = 16) -> float:
    """Milliseconds the engine thread spends on one snapshot of a large pool, half in use by
    32 requests (the part of the page's cost that stalls a step)."""
    from pagedllm.config import SchedulerConfig
    from pagedllm.core.kv_cache import KVCacheManager
    from pagedllm.core.request import Request, SamplingParams
    from pagedllm.core.scheduler import Scheduler
    from pagedllm.core.snapshot import take_snapshot

    scheduler = Scheduler(SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=1 << 20,
                                          max_model_len=1 << 20),
                          KVCacheManager(num_blocks, block_size))
    for i in range(32):
        scheduler.add_request(Request(f"r{i}", list(range(i, i + num_blocks * block_size // 64)),
                                      SamplingParams(max_tokens=1), max_model_len=1 << 20))
    scheduler.schedule()
    started = time.perf_counter()
    for _ in range(20):
        take_snapshot(scheduler)
    return (time.perf_counter() - started) / 20 * 1000


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--kv-cache-memory", default=str(256 << 20))
    add_smoke(parser)
    args = parser.parse_args()
    if args.smoke:
        args.rounds, args.concurrency, args.max_tokens = 2, 2, 8
    print(f"one engine snapshot of a 16,384-block pool, half in use: {snapshot_cost():.2f} ms")
    server = ServerProcess("--kv-cache-memory", args.kv_cache_memory, log_path="/tmp/page-overhead.log")
    try:
        load(server.url, args.concurrency, 16)  # warm-up
        closed, opened, snapshots = [], [], []

        def with_page_open() -> float:
            stop, seen = threading.Event(), []
            watcher = threading.Thread(target=watch, args=(server.url, stop, seen))
            watcher.start()
            rate = load(server.url, args.concurrency, args.max_tokens)
            stop.set()
            watcher.join()
            snapshots.append(len(seen))
            return rate

        for round_ in range(args.rounds):
            # Which variant goes first alternates, so a drift of the host favours neither.
            if round_ % 2:
                opened.append(with_page_open())
                closed.append(load(server.url, args.concurrency, args.max_tokens))
            else:
                closed.append(load(server.url, args.concurrency, args.max_tokens))
                opened.append(with_page_open())
        print("page closed, output tok/s:", ", ".join(f"{v:.1f}" for v in closed))
        print("page open,   output tok/s:", ", ".join(f"{v:.1f}" for v in opened),
              f"(snapshots read: {snapshots})")
        ratio = statistics.median(opened) / statistics.median(closed)
        print(f"median open / closed: {ratio:.3f} ({(1 - ratio) * 100:+.1f} % slower with the page open)")
    finally:
        server.stop()


if __name__ == "__main__":
    main()
