"""A model store on one machine: how long each model takes to load on its first request, and
what two models busy at once get against one busy alone (each its own engine and loop
thread in one process, sharing the cores).

    .venv/bin/python benchmarks/model_store.py [--clients 4] [--tokens 64] [--threads N]

The store holds the bundled model twice (two names, two engines, the same file) and,
with --second PATH, another model instead of the second copy. For each level it sends
--clients streaming requests per busy model (--tokens each, ignoring EOS) and prints total
generated tokens/s, each model's, and the ratio of two busy models' total to one alone.
--threads is passed to serve (compute threads per engine).
"""
from __future__ import annotations

import argparse
import concurrent.futures
import os
import sys
import tempfile
import time

import httpx

from pagedllm.weights import default_model_path

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from server_process import ServerProcess  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from timing import add_smoke, smoke_or  # noqa: E402

PROMPT = [{"role": "user", "content": "Tell me a long story about the sea."}]


def ask(url: str, model: str, tokens: int) -> tuple[str, int]:
    body = {"model": model, "messages": PROMPT, "max_tokens": tokens, "ignore_eos": True,
            "temperature": 0}
    answer = httpx.post(url + "/v1/chat/completions", json=body, timeout=600).raise_for_status()
    return model, answer.json()["usage"]["completion_tokens"]


def busy(url: str, models: list[str], clients: int, tokens: int) -> tuple[float, dict]:
    """Total tokens/s and each model's, with `clients` requests per model at once."""
    jobs = [m for m in models for _ in range(clients)]
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(lambda m: ask(url, m, tokens), jobs))
    seconds = time.perf_counter() - start
    per_model = {m: sum(n for name, n in results if name == m) / seconds for m in models}
    return sum(per_model.values()), per_model


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--second", default=None, help="another model file for the second name")
    add_smoke(parser)
    args = parser.parse_args()
    args.clients, args.tokens = smoke_or((args.clients, args.tokens), (1, 4))
    folder = tempfile.mkdtemp(prefix="pagedllm-store-")
    os.symlink(default_model_path(), os.path.join(folder, "first.gguf"))
    second = os.path.abspath(args.second) if args.second else default_model_path()
    os.symlink(second, os.path.join(folder, "second" + (".gguf" if os.path.isfile(second) else "")))
    extra = ["--threads", str(args.threads)] if args.threads else []
    server = ServerProcess("--models-dir", folder, "--kv-cache-memory", "256MiB", *extra,
                           log_path="/tmp/pagedllm-store-bench.log")
    try:
        print(f"cores: {os.cpu_count()}; threads per engine: {args.threads or 'default'}; "
              f"{args.clients} clients per busy model, {args.tokens} tokens each")
        for model in ("first", "second"):
            start = time.perf_counter()
            ask(server.url, model, 1)
            cold = time.perf_counter() - start
            start = time.perf_counter()
            ask(server.url, model, 1)
            warm = time.perf_counter() - start
            print(f"{model}: first request {cold:.2f} s (load + answer), next {warm:.2f} s; "
                  f"load alone {cold - warm:.2f} s")
        busy(server.url, ["first"], 1, 8)  # warm-up
        alone, _ = busy(server.url, ["first"], args.clients, args.tokens)
        together, each = busy(server.url, ["first", "second"], args.clients, args.tokens)
        print(f"one model busy alone:   {alone:7.1f} generated tokens/s")
        print(f"two models busy at once: {together:7.1f} generated tokens/s "
              f"({', '.join(f'{m} {v:.1f}' for m, v in each.items())})")
        print(f"ratio two at once / one alone: {together / alone:.2f}x")
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
