"""Two engine replicas on Ray Serve: prefix-cache-aware routing against Ray Serve's default
power-of-two-choices router, in one run; then 2 replicas x 1 thread against 1 replica x 2
threads on the same machine (and against the single-process server, no Ray, 2 threads).

    .venv/bin/python benchmarks/replica_routing.py [--conversations 8] [--turns 4] [--two-nodes]

--two-nodes: the router comparison only, on a two-node Ray cluster made on this machine
(Ray's cluster_utils: two raylets of 1 CPU each, one replica a node). The nodes share this
machine's cores, so it measures placement and routing, not what two machines would give.

Workload: N conversations at once, each of T turns (a turn waits for the previous answer),
each opening with a ~600-token system prompt, either one prompt for all ("shared") or one per
conversation ("distinct"). Per router and workload it prints the prefix-cache hit rate (the
replicas' own counters, summed) and time to first token p50 / p95 over every turn after the
first (the turns that could find their conversation's prefix), and the ratios.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import os
import re
import statistics
import sys
import time

import httpx

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from server_process import ServerProcess  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import add_smoke  # noqa: E402

MODEL = "SmolLM2-135M-Instruct.Q4_1"
TOPICS = ("astronomy", "baking", "cycling", "databases", "economics", "forestry", "geology",
          "harbours", "irrigation", "jazz", "knitting", "linguistics")


def system_prompt(k: int) -> str:
    topic = TOPICS[k % len(TOPICS)]
    rules = " ".join(f"Rule {i}: when asked about {topic}, answer briefly, cite one fact, and "
                     f"keep a friendly tone." for i in range(1, 28))
    return f"You are assistant {k}, an expert in {topic}. {rules}"


def counters(url: str) -> tuple[float, float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    total = lambda name: sum(float(v) for v in re.findall(  # noqa: E731
        rf"^pagedllm:{name}_total{{[^}}]*}} (\S+)$", text, re.M))
    return total("prefix_cache_hits"), total("prefix_cache_queries")


def stream_ttft(url: str, messages: list, max_tokens: int) -> tuple[float, str]:
    started = time.perf_counter()
    ttft, text = None, []
    with httpx.stream("POST", url + "/v1/chat/completions", timeout=600, json={
            "model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            if '"content"' in line and ttft is None and '"content":""' not in line.replace(" ", ""):
                ttft = time.perf_counter() - started
            piece = re.search(r'"content":\s*"((?:[^"\\]|\\.)*)"', line)
            if piece:
                text.append(piece.group(1))
    return ttft or (time.perf_counter() - started), "".join(text)


def conversation(url: str, k: int, shared: bool, turns: int, max_tokens: int) -> list[float]:
    messages = [{"role": "system", "content": system_prompt(0 if shared else k)}]
    ttfts = []
    for turn in range(turns):
        messages.append({"role": "user", "content": f"Question {turn} of user {k}: tell me one "
                                                    f"thing worth knowing."})
        ttft, answer = stream_ttft(url, messages, max_tokens)
        messages.append({"role": "assistant", "content": answer})
        if turn:
            ttfts.append(ttft)
    return ttfts


def workload(url: str, shared: bool, conversations: int, turns: int, max_tokens: int) -> dict:
    hits0, queries0 = counters(url)
    with concurrent.futures.ThreadPoolExecutor(conversations) as pool:
        results = list(pool.map(lambda k: conversation(url, k, shared, turns, max_tokens),
                                range(conversations)))
    time.sleep(1.5)  # the replicas post their counters twice a second
    hits1, queries1 = counters(url)
    ttfts = sorted(t for r in results for t in r)
    return {"hit_rate": (hits1 - hits0) / max(1.0, queries1 - queries0),
            "ttft_p50": statistics.median(ttfts),
            "ttft_p95": ttfts[min(len(ttfts) - 1, int(0.95 * len(ttfts)))]}


def start(*args: str) -> ServerProcess:
    server = ServerProcess(*args, log_path=f"/tmp/replica_routing_{os.getpid()}.log",
                           wait_ready=False)
    server.wait_ready(timeout=300)
    return server


def throughput(url: str, requests: int, max_tokens: int) -> float:
    def one(i):
        r = httpx.post(url + "/v1/completions", timeout=600, json={
            "model": MODEL, "prompt": f"Story {i}: once upon a time", "max_tokens": max_tokens,
            "ignore_eos": True, "temperature": 0})
        return r.json()["usage"]["completion_tokens"]

    one(-1)  # warm-up
    started = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(requests) as pool:
        tokens = sum(pool.map(one, range(requests)))
    return tokens / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32, help="per answer")
    parser.add_argument("--kv-cache-memory", default="256MiB", help="per replica")
    parser.add_argument("--throughput-requests", type=int, default=8)
    parser.add_argument("--throughput-tokens", type=int, default=128)
    parser.add_argument("--two-nodes", action="store_true",
                        help="the router comparison on a two-node cluster, nothing else")
    add_smoke(parser)
    args = parser.parse_args()
    if args.smoke:
        args.conversations, args.turns, args.max_tokens = 2, 2, 4
        args.throughput_requests, args.throughput_tokens = 2, 4
    common = ("--kv-cache-memory", args.kv_cache_memory, "--max-num-seqs", "8")
    cluster = None
    if args.two_nodes:
        from ray.cluster_utils import Cluster

        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
        cluster.add_node(num_cpus=1)
        common += ("--ray-address", cluster.address, "--threads-per-replica", "1",
                   "--replicas-per-node", "1")

    table = {}
    for router in ("prefix", "pow2"):
        server = start("--replicas", "2", "--router", router, *common)
        try:
            for shared in (True, False):
                name = "shared" if shared else "distinct"
                table[router, name] = row = workload(server.url, shared, args.conversations,
                                                     args.turns, args.max_tokens)
                print(f"{router:>6} router, {name:>8} system prompts: prefix-cache hit rate "
                      f"{row['hit_rate']:.1%}, TTFT p50 {row['ttft_p50'] * 1000:.0f} ms, "
                      f"p95 {row['ttft_p95'] * 1000:.0f} ms", flush=True)
        finally:
            server.stop()
    for name in ("shared", "distinct"):
        ours, theirs = table["prefix", name], table["pow2", name]
        print(f"{name}: hit rate {ours['hit_rate']:.1%} vs {theirs['hit_rate']:.1%}; "
              f"TTFT p50 {theirs['ttft_p50'] / ours['ttft_p50']:.2f}x faster, "
              f"p95 {theirs['ttft_p95'] / ours['ttft_p95']:.2f}x faster with prefix routing")
    if cluster is not None:
        cluster.shutdown()
        return

    rates = {}
    for label, layout in (("2 replicas x 1 thread", ("--replicas", "2", "--threads-per-replica", "1")),
                          ("1 replica x 2 threads", ("--replicas", "1", "--threads-per-replica", "2")),
                          ("no Ray, 1 process x 2 threads", ("--threads", "2"))):
        server = start(*layout, *common)
        try:
            rates[label] = throughput(server.url, args.throughput_requests, args.throughput_tokens)
        finally:
            server.stop()
        print(f"{label}: {rates[label]:.0f} output tokens/s ({args.throughput_requests} requests "
              f"of {args.throughput_tokens} tokens at once)", flush=True)
    two, one, plain = rates.values()
    print(f"2 replicas x 1 thread / 1 replica x 2 threads: {two / one:.2f}x; "
          f"/ the single-process server: {two / plain:.2f}x")


if __name__ == "__main__":
    main()
