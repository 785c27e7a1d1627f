"""The host side alone: a model whose step costs almost nothing (random weights, hidden 32,
2 layers, the default model's tokenizer), so that what is measured is the server around the
engine: streamed output tokens/s at N concurrent requests through `pagedllm serve` in one
process and with --engine-process, against the engine alone (LLMEngine stepped in this
process, no HTTP), all in one run.

    .venv/bin/python benchmarks/host_overhead.py [--concurrency 64,256] [--max-tokens 128]
        [--model PATH]   # any GGUF instead of the tiny one (the default model: --model default)

Prints, per N: engine alone, one process, two processes (tokens/s, and each server's over
the engine alone), and the two-process server over the one-process one. The load comes
from this process (asyncio + httpx, one streamed completion per request, tokens counted
from the final usage chunk), so its own CPU is on the same cores: the same for both servers.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))

TINY_SHAPE = dict(hidden=32, layers=2, heads=4, kv_heads=2, intermediate=64, context=2048,
                  rope_theta=10000.0)
PROMPT = "Tell me a long story about a lighthouse keeper and the sea. " * 3


def engine_alone(model: str, concurrency: int, max_tokens: int) -> float:
    from pagedllm.core.request import SamplingParams
    from pagedllm.engine.engine import LLMEngine

    engine = LLMEngine(model, max_num_seqs=concurrency, kv_cache_memory=256 << 20)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i in range(concurrency):
        engine.add_request(f"r{i}", PROMPT, params)
    start, generated = time.perf_counter(), 0
    while engine.has_unfinished_requests():
        generated += sum(len(out.new_token_ids) for out in engine.step())
    return generated / (time.perf_counter() - start)


async def _one(client, url: str, max_tokens: int) -> int:
    body = {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    tokens = 0
    async with client.stream("POST", url + "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                usage = json.loads(line[6:]).get("usage")
                if usage:
                    tokens = usage["completion_tokens"]
    return tokens


async def _load(url: str, concurrency: int, max_tokens: int) -> float:
    import httpx

    limits = httpx.Limits(max_connections=concurrency + 8)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        await _one(client, url, 4)  # warm-up
        start = time.perf_counter()
        counts = await asyncio.gather(*(_one(client, url, max_tokens) for _ in range(concurrency)))
    assert all(c == max_tokens for c in counts), counts
    return sum(counts) / (time.perf_counter() - start)


def served(model: str, concurrency: int, max_tokens: int, engine_process: bool) -> float:
    from realistic_size import wait_ready

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "pagedllm.cli", "serve", "--model", model, "--port",
               str(port), "--max-num-seqs", str(concurrency), "--kv-cache-memory",
               str(256 << 20), "--max-connections-per-client", "0", "--log-level", "warning"]
    if engine_process:
        command.append("--engine-process")
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, process)
        return asyncio.run(_load(url, concurrency, max_tokens))
    finally:
        process.terminate()
        process.wait(60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", default="64,256")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--model", default=None,
                        help="a GGUF file, or `default` (default: a tiny random model)")
    args = parser.parse_args()
    if args.model == "default":
        from pagedllm.weights import default_model_path

        model = default_model_path()
    elif args.model:
        model = args.model
    else:
        from realistic_size import write_random_f16

        model = os.path.join(tempfile.mkdtemp(), "tiny-random.gguf")
        write_random_f16(model, TINY_SHAPE)
    import torch

    print(f"model {os.path.basename(model)}, {torch.get_num_threads()} threads, "
          f"{args.max_tokens} output tokens a request")
    for concurrency in (int(n) for n in args.concurrency.split(",")):
        alone = engine_alone(model, concurrency, args.max_tokens)
        one = served(model, concurrency, args.max_tokens, engine_process=False)
        two = served(model, concurrency, args.max_tokens, engine_process=True)
        print(f"N={concurrency}: engine alone {alone:,.0f} tok/s; served, one process "
              f"{one:,.0f} ({one / alone:.2f}x alone); --engine-process {two:,.0f} "
              f"({two / alone:.2f}x alone); two processes / one: {two / one:.2f}x", flush=True)


if __name__ == "__main__":
    main()
