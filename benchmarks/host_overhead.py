"""The host side alone: a model whose step costs almost nothing (the tests' tiny random
Qwen3: hidden 64, heads of 64 as the C++ kernels take them, 2 layers, a byte-level
vocabulary of 260 tokens, so no LM head over 49k words hides the host's work), so that what is measured is the server around the engine: streamed output tokens/s at N concurrent requests through `pagedllm serve` in one
process and with --engine-process, against the engine alone (LLMEngine stepped in this
process, no HTTP), all in one run.

    .venv/bin/python benchmarks/host_overhead.py [--concurrency 64,256] [--max-tokens 128]
        [--model PATH]   # any model instead of the tiny one (the default model: --model default)

Prints, per N: engine alone, one process, two processes (tokens/s, and each server's over
the engine alone), and the two-process server over the one-process one. The load comes
from this process (asyncio over raw sockets, one streamed completion per request, tokens
counted from the final usage chunk), so its own CPU is on the same cores: the same
for both servers.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))  # tiny_models

PROMPT = "Tell me a long story about a lighthouse keeper and the sea. " * 3


def serve_args(model: str, concurrency: int) -> list[str]:
    return ["--model", model, "--max-num-seqs", str(concurrency), "--kv-cache-memory",
            str(256 << 20)]


def engine_alone(model: str, concurrency: int, max_tokens: int) -> float:
    """The engine as `serve` builds it from the same options, stepped here."""
    import argparse

    from pagedllm.cli.options import engine_config
    from pagedllm.cli.serve import add_serve_args
    from pagedllm.core.request import SamplingParams
    from pagedllm.engine.engine import LLMEngine

    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    engine = LLMEngine(engine_config(parser.parse_args(serve_args(model, concurrency))))
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i in range(concurrency):
        engine.add_request(f"r{i}", PROMPT, params)
    start, generated = time.perf_counter(), 0
    while engine.has_unfinished_requests():
        generated += sum(len(out.new_token_ids) for out in engine.step())
    return generated / (time.perf_counter() - start)


async def _one(port: int, max_tokens: int) -> int:
    """One streamed completion over a raw socket: a load generator whose own CPU per token is
    a fraction of an SSE client library's (it shares the cores with the server), reading
    the answer in blocks and only its last usage chunk as JSON."""
    body = json.dumps({"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
                       "ignore_eos": True, "stream": True,
                       "stream_options": {"include_usage": True}}).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                 b"Content-Type: application/json\r\nConnection: close\r\n"
                 b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    tail = b""
    while block := await reader.read(1 << 16):
        tail = (tail + block)[-4096:]
    writer.close()
    event = re.findall(rb"data: (\{[^\n]*\"usage\"[^\n]*\})\n", tail)[-1]
    return json.loads(event)["usage"]["completion_tokens"]


async def _load(port: int, concurrency: int, max_tokens: int) -> float:
    await _one(port, 4)  # warm-up
    start = time.perf_counter()
    counts = await asyncio.gather(*(_one(port, max_tokens) for _ in range(concurrency)))
    assert all(c == max_tokens for c in counts), counts
    return sum(counts) / (time.perf_counter() - start)


def served(model: str, concurrency: int, max_tokens: int, engine_process: bool,
           threads: int | None = None) -> float:
    from realistic_size import wait_ready

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "pagedllm.cli", "serve", *serve_args(model, concurrency),
               "--port", str(port), "--max-connections-per-client", "0", "--log-level",
               "warning"]
    if engine_process:
        command.append("--engine-process")
    if threads:
        command += ["--threads", str(threads)]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, process)
        return asyncio.run(_load(port, concurrency, max_tokens))
    finally:
        process.terminate()
        process.wait(60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", default="64,256")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--one-process-only", action="store_true",
                        help="only the engine alone and the one-process server (an A/B against "
                             "a commit before --engine-process: its `src` first on PYTHONPATH)")
    parser.add_argument("--engine-threads", type=int, default=None,
                        help="--threads for the --engine-process server (default: its own)")
    parser.add_argument("--model", default=None,
                        help="a GGUF file or folder, or `default` (default: a tiny random model)")
    args = parser.parse_args()
    if args.model == "default":
        from pagedllm.weights import default_model_path

        model = default_model_path()
    elif args.model:
        model = args.model
    else:
        from tiny_models import tiny_hf_model, write_hf_folder

        model = write_hf_folder(tiny_hf_model("qwen3"), tempfile.mkdtemp())
    import torch

    print(f"model {os.path.basename(model)}, {torch.get_num_threads()} threads, "
          f"{args.max_tokens} output tokens a request")
    for concurrency in (int(n) for n in args.concurrency.split(",")):
        alone = engine_alone(model, concurrency, args.max_tokens)
        one = served(model, concurrency, args.max_tokens, engine_process=False)
        line = (f"N={concurrency}: engine alone {alone:,.0f} tok/s; served, one process "
                f"{one:,.0f} ({one / alone:.2f}x alone)")
        if not args.one_process_only:
            two = served(model, concurrency, args.max_tokens, engine_process=True,
                         threads=args.engine_threads)
            line += (f"; --engine-process {two:,.0f} ({two / alone:.2f}x alone); two "
                     f"processes / one: {two / one:.2f}x")
        print(line, flush=True)


if __name__ == "__main__":
    main()
