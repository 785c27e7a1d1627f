"""The server around the engine: streamed output tokens/s at N concurrent requests through
`pagedllm serve` in one process and with --engine-process, against the engine alone
(LLMEngine stepped in this process, no HTTP), all in one run.

By default on a model whose step costs almost nothing (the tests' tiny random Qwen3: hidden
64, heads of 64 as the C++ kernels take them, 2 layers, a byte-level vocabulary of 260
tokens, so no LM head over 49k words hides the host's work): what is measured is the host.

    .venv/bin/python benchmarks/host_overhead.py [--concurrency 64,256] [--max-tokens 128]
        [--model PATH|default] [--engine-threads N] [--one-process-only]
        [--serve-args "--device cuda"] [--overlap-ab] [--json OUT.json]

Each configuration starts once and runs every level. Prints, per N: tokens/s of the engine
alone, of one process and of two (each over the engine alone), TTFT and TPOT medians as
served, and the server's CPU (every process of it) in seconds per 1,000 output tokens. The
--overlap-ab runs the engine alone and the --engine-process server with --no-overlap-steps
and with --overlap-steps (engine/overlap.py) instead of once at the default, and prints
their ratios (the other lines then use the overlapped ones). The
load comes from this process over raw sockets (a client library's own CPU per token, on
the same cores, hid the server's), tokens counted from the final usage chunk.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))  # tiny_models

from timing import add_smoke  # noqa: E402

PROMPT = "Tell me a long story about a lighthouse keeper and the sea. " * 3


def model_path(model: str | None) -> str:
    """--model: a path, `default` (the default model), or None: the tiny random model."""
    if model == "default":
        from pagedllm.weights import default_model_path

        return default_model_path()
    if model:
        return model
    from tiny_models import tiny_hf_model, write_hf_folder

    return write_hf_folder(tiny_hf_model("qwen3"), tempfile.mkdtemp())


def serve_args(model: str, concurrency: int, extra: list[str]) -> list[str]:
    kv = [] if "--device" in extra else ["--kv-cache-memory", str(256 << 20)]
    return ["--model", model, "--max-num-seqs", str(concurrency), *kv, *extra]


def engine_alone(model: str, levels: list[int], max_tokens: int, extra: list[str]) -> dict:
    """The engine as `serve` builds it from the same options, stepped here: tok/s per N."""
    from pagedllm.cli.options import engine_config
    from pagedllm.cli.serve import add_serve_args
    from pagedllm.core.request import SamplingParams
    from pagedllm.engine.engine import LLMEngine

    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    engine = LLMEngine(engine_config(parser.parse_args(serve_args(model, max(levels), extra))))
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    results = {}
    for n in levels:
        for i in range(n):
            engine.add_request(f"n{n}-{i}", PROMPT, params)
        start, generated = time.perf_counter(), 0
        while engine.has_unfinished_requests():
            generated += sum(len(out.new_token_ids) for out in engine.step())
        results[n] = {"tokens_per_s": generated / (time.perf_counter() - start)}
    del engine
    return results


async def _one(port: int, max_tokens: int) -> tuple[int, float, float]:
    """One streamed completion over a raw socket, reading the answer in blocks and only its
    last usage chunk as JSON: (tokens, seconds to the first token's block, seconds in all)."""
    body = json.dumps({"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
                       "ignore_eos": True, "stream": True,
                       "stream_options": {"include_usage": True}}).encode()
    start = time.perf_counter()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                 b"Content-Type: application/json\r\nConnection: close\r\n"
                 b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    tail, first = b"", None
    while block := await reader.read(1 << 16):
        if first is None and b'"text"' in block:
            first = time.perf_counter() - start
        tail = (tail + block)[-4096:]
    writer.close()
    event = re.findall(rb"data: (\{[^\n]*\"usage\"[^\n]*\})\n", tail)[-1]
    tokens = json.loads(event)["usage"]["completion_tokens"]
    return tokens, first or 0.0, time.perf_counter() - start


async def _level(port: int, concurrency: int, max_tokens: int) -> dict:
    start = time.perf_counter()
    done = await asyncio.gather(*(_one(port, max_tokens) for _ in range(concurrency)))
    wall = time.perf_counter() - start
    assert all(tokens == max_tokens for tokens, _, _ in done), done
    return {"tokens_per_s": sum(t for t, _, _ in done) / wall,
            "ttft_s": statistics.median(f for _, f, _ in done),
            "tpot_ms": 1000 * statistics.median((e - f) / max(1, t - 1) for t, f, e in done)}


def served(model: str, levels: list[int], max_tokens: int, engine_process: bool,
           extra: list[str], threads: int | None = None) -> dict:
    """One server for every level: tok/s, TTFT and TPOT medians, the server's CPU seconds
    (all its processes) per 1,000 output tokens."""
    import psutil

    from realistic_size import wait_ready

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "pagedllm.cli", "serve",
               *serve_args(model, max(levels), extra), "--port", str(port),
               "--max-connections-per-client", "0", "--log-level", "warning"]
    if engine_process:
        command.append("--engine-process")
    if threads:
        command += ["--threads", str(threads)]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_ready(f"http://127.0.0.1:{port}", process)
        asyncio.run(_one(port, 4))  # warm-up
        results = {}
        for n in levels:
            tree = [psutil.Process(process.pid), *psutil.Process(process.pid).children(True)]
            before = sum(sum(p.cpu_times()[:2]) for p in tree)
            results[n] = asyncio.run(_level(port, n, max_tokens))
            after = sum(sum(p.cpu_times()[:2]) for p in tree if p.is_running())
            results[n]["server_cpu_s_per_1k_tokens"] = 1000 * (after - before) / (n * max_tokens)
        return results
    finally:
        process.terminate()
        process.wait(60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", default="64,256")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--engine-threads", type=int, default=None,
                        help="--threads for the --engine-process server (default: its own)")
    parser.add_argument("--one-process-only", action="store_true",
                        help="only the engine alone and the one-process server (an A/B against "
                             "a commit before --engine-process: its `src` first on PYTHONPATH)")
    parser.add_argument("--serve-args", default="",
                        help="more serve options for all three (\"--device cuda\")")
    parser.add_argument("--overlap-ab", action="store_true",
                        help="also the engine alone and --engine-process with and without "
                             "--overlap-steps")
    parser.add_argument("--json", default=None, help="write the figures here too")
    parser.add_argument("--model", default=None,
                        help="a GGUF file or folder, or `default` (default: a tiny random model)")
    add_smoke(parser)
    args = parser.parse_args()
    if args.smoke:
        args.concurrency, args.max_tokens = "2", 4
    model = model_path(args.model)
    import torch

    levels = [int(n) for n in args.concurrency.split(",")]
    extra = shlex.split(args.serve_args)
    print(f"model {os.path.basename(model)}, {torch.get_num_threads()} threads, "
          f"{args.max_tokens} output tokens a request, serve {' '.join(extra) or '(defaults)'}",
          flush=True)
    figures: dict = {}

    def keep(name: str, result: dict) -> None:  # written as each finishes: a run cut short
        figures[name] = result  # by its time limit keeps what it measured
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"model": model, "max_tokens": args.max_tokens, "serve_args": extra,
                           "levels": figures}, f, indent=1)

    # With --overlap-ab the engine alone and the engine process run both ways (instead of
    # once at the default), steps one at a time first.
    ways = ([("overlap_off", ["--no-overlap-steps"]), ("overlap_on", ["--overlap-steps"])]
            if args.overlap_ab else [("default", [])])
    for way, flags in ways:
        keep(f"alone_{way}", engine_alone(model, levels, args.max_tokens, [*extra, *flags]))
    figures["alone"] = figures[f"alone_{ways[-1][0]}"]
    keep("one_process", served(model, levels, args.max_tokens, False, extra))
    if not args.one_process_only:
        for way, flags in ways:
            keep(f"engine_process_{way}", served(model, levels, args.max_tokens, True,
                                                 [*extra, *flags], args.engine_threads))
        figures["engine_process"] = figures[f"engine_process_{ways[-1][0]}"]
    if args.overlap_ab:
        for n in levels:
            on, off = (figures[f"alone_overlap_{x}"][n]["tokens_per_s"] for x in ("on", "off"))
            served_on, served_off = (figures.get(f"engine_process_overlap_{x}", {}).get(n)
                                     for x in ("on", "off"))
            if served_on is None:
                print(f"N={n}: overlapped steps / one at a time: engine alone {on / off:.2f}x")
                continue
            print(f"N={n}: overlapped steps / one at a time: engine alone {on:,.0f} / {off:,.0f} "
                  f"tok/s ({on / off:.2f}x); --engine-process {served_on['tokens_per_s']:,.0f} / "
                  f"{served_off['tokens_per_s']:,.0f} tok/s "
                  f"({served_on['tokens_per_s'] / served_off['tokens_per_s']:.2f}x, TPOT "
                  f"{served_on['tpot_ms']:.1f} / {served_off['tpot_ms']:.1f} ms)", flush=True)
    for n in levels:
        alone, one = figures["alone"][n]["tokens_per_s"], figures["one_process"][n]
        line = (f"N={n}: engine alone {alone:,.0f} tok/s; one process {one['tokens_per_s']:,.0f} "
                f"({one['tokens_per_s'] / alone:.2f}x alone, TTFT {one['ttft_s']:.2f} s, TPOT "
                f"{one['tpot_ms']:.1f} ms, {one['server_cpu_s_per_1k_tokens']:.2f} CPU s/1k tok)")
        if "engine_process" in figures:
            two = figures["engine_process"][n]
            line += (f"; --engine-process {two['tokens_per_s']:,.0f} ({two['tokens_per_s'] / alone:.2f}x "
                     f"alone, TTFT {two['ttft_s']:.2f} s, TPOT {two['tpot_ms']:.1f} ms, "
                     f"{two['server_cpu_s_per_1k_tokens']:.2f} CPU s/1k tok); two processes / "
                     f"one: {two['tokens_per_s'] / one['tokens_per_s']:.2f}x")
        print(line, flush=True)


if __name__ == "__main__":
    main()
