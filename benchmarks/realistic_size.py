"""A model of a real 1-2B shape, quantized as teams download it, served by pagedllm and by
llama.cpp's server on the same file and host, under the same load.

    # once: random weights of SmolLM2-1.7B's shape (hidden 2048, 24 layers, 32 heads,
    # intermediate 8192, its tokenizer), F16, then llama.cpp's own llama-quantize to Q4_K_M
    .venv/bin/python benchmarks/realistic_size.py make --llama-quantize PATH [--out DIR]
    # the load: streaming completions, prompts of 64-256 tokens, 64 output tokens, N = 1, 8
    .venv/bin/python benchmarks/realistic_size.py run --model DIR/smollm2-1.7b-random-Q4_K_M.gguf \\
        --llama-server PATH [--concurrency 1,8] [--requests 16]
    # both servers up at once, one request (or one round of N) to each in turn, so that both
    # meet the same moment of a shared host's memory bandwidth: TPOT and tokens/s per round,
    # the medians and the median of the paired ratios
    .venv/bin/python benchmarks/realistic_size.py paired --model DIR/smollm2-1.7b-random-Q4_K_M.gguf \
        --llama-server PATH [--rounds 12] [--concurrency 1,8]
    # in this process: load time, resident memory and its high-water mark, then the
    # projections and the head alone at one row, all layers back to back (the bytes a decode
    # step must read, against the memory bandwidth)
    .venv/bin/python benchmarks/realistic_size.py load --model DIR/smollm2-1.7b-random-Q4_K_M.gguf

Prints, per server: resident memory once loaded (and the file's size), load time, and
`pagedllm bench`'s total tokens/s, TTFT and TPOT; then pagedllm's ratios over llama.cpp and
how close decode at N=1 runs to this host's memory bandwidth (bytes of weights read per
token / TPOT, against a read of a 1 GiB tensor measured in the same run). Nothing of
llama.cpp is in this repository: build it from any source (BENCHMARKS.md says which).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

SHAPE = dict(hidden=2048, layers=24, heads=32, kv_heads=32, intermediate=8192, context=8192,
             rope_theta=130000.0)
# The default model's own shape, for a machine that cannot hold its package (the GPU one).
SHAPE_135M = dict(hidden=576, layers=30, heads=9, kv_heads=3, intermediate=1536, context=8192,
                  rope_theta=100000.0)
F16_NAME, Q4_K_M_NAME = "smollm2-1.7b-random-F16.gguf", "smollm2-1.7b-random-Q4_K_M.gguf"


def writer_with_default_tokenizer(path: str, shape: dict = SHAPE,
                                  tokenizer_source: str | None = None):
    """A GGUF writer holding the shape's header and the default model's tokenizer (read
    from `tokenizer_source`, any GGUF holding it, else the default model), and the size of
    that vocabulary."""
    import gguf

    from pagedllm.weights import default_model_path

    source = gguf.GGUFReader(tokenizer_source or default_model_path())
    vocab = len(source.fields["tokenizer.ggml.tokens"].contents())
    writer = gguf.GGUFWriter(path, "llama")
    if shape is not None:
        writer.add_context_length(shape["context"])
        writer.add_embedding_length(shape["hidden"])
        writer.add_block_count(shape["layers"])
        writer.add_feed_forward_length(shape["intermediate"])
        writer.add_head_count(shape["heads"])
        writer.add_head_count_kv(shape["kv_heads"])
        writer.add_rope_freq_base(shape["rope_theta"])
        writer.add_layer_norm_rms_eps(1e-5)
    for name, field in source.fields.items():
        if not name.startswith("tokenizer."):
            continue
        value = field.contents()
        if isinstance(value, list):
            writer.add_array(name, value)
        elif isinstance(value, str):
            writer.add_string(name, value)
        elif isinstance(value, bool):
            writer.add_bool(name, value)
        else:
            writer.add_uint32(name, int(value))
    return writer, vocab


def write_tokenizer_only(path: str) -> None:
    """The default model's tokenizer alone in a GGUF (about 1 MB, no tensors): what a machine
    without the model's package needs to write the random models above."""
    writer, _ = writer_with_default_tokenizer(path, shape=None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()


def write_random_q4_0(path: str, shape: dict = SHAPE, tokenizer_source: str | None = None) -> None:
    """As write_random_f16, but every projection random Q4_0 blocks (codes uniform, d of a
    Normal(0, 0.02) matrix's size), written directly: quantizing 1.7B weights in numpy
    would take minutes. The embedding (tied head) stays F16."""
    import gguf

    scale = np.frombuffer(np.float16(0.02 / 4).tobytes(), dtype=np.uint8)

    def blocks(rng, rows: int, cols: int) -> tuple[np.ndarray, object]:
        data = rng.integers(0, 256, size=(rows, cols // 32, 18), dtype=np.uint8)
        data[:, :, 0:2] = scale
        return data.reshape(rows, -1), gguf.GGMLQuantizationType.Q4_0

    _write_random(path, shape, tokenizer_source, gguf.LlamaFileType.MOSTLY_Q4_0, blocks)


def write_random_f16(path: str, shape: dict = SHAPE, tokenizer_source: str | None = None) -> None:
    """Normal(0, 0.02) weights in the shape's layout (SmolLM2-1.7B's unless told), the
    default model's tokenizer, the embedding tied to the head as in SmolLM2."""
    import gguf

    _write_random(path, shape, tokenizer_source, gguf.LlamaFileType.MOSTLY_F16,
                  lambda rng, rows, cols: (_normal_f16(rng, rows, cols), None))


def _normal_f16(rng, rows: int, cols: int) -> np.ndarray:
    return (rng.standard_normal((rows, cols), dtype=np.float32) * 0.02).astype(np.float16)


def _write_random(path: str, shape: dict, tokenizer_source: str | None, file_type,
                  projection) -> None:
    """The shape's tensors, F16 embedding and float32 norms, each projection as
    projection(rng, rows, cols) gives it: (array, raw GGUF type or None)."""
    writer, vocab = writer_with_default_tokenizer(path, shape, tokenizer_source)
    writer.add_file_type(file_type)
    rng = np.random.default_rng(0)
    h, i = shape["hidden"], shape["intermediate"]
    kv = shape["kv_heads"] * (h // shape["heads"])
    writer.add_tensor("token_embd.weight", _normal_f16(rng, vocab, h))
    writer.add_tensor("output_norm.weight", np.ones(h, dtype=np.float32))
    for layer in range(shape["layers"]):
        prefix = f"blk.{layer}."
        for name, (rows, cols) in {"attn_q": (h, h), "attn_k": (kv, h), "attn_v": (kv, h),
                                   "attn_output": (h, h), "ffn_gate": (i, h), "ffn_up": (i, h),
                                   "ffn_down": (h, i)}.items():
            array, raw = projection(rng, rows, cols)
            writer.add_tensor(prefix + name + ".weight", array,
                              **({"raw_dtype": raw} if raw is not None else {}))
        writer.add_tensor(prefix + "attn_norm.weight", np.ones(h, dtype=np.float32))
        writer.add_tensor(prefix + "ffn_norm.weight", np.ones(h, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def cmd_make(args) -> None:
    os.makedirs(args.out, exist_ok=True)
    f16, q4 = os.path.join(args.out, F16_NAME), os.path.join(args.out, Q4_K_M_NAME)
    if not os.path.exists(f16):
        write_random_f16(f16)
    subprocess.run([args.llama_quantize, f16, q4, "Q4_K_M", "2"], check=True)
    print(f"wrote {q4} ({os.path.getsize(q4) / 2**30:.2f} GiB)")


def memory_read_bandwidth() -> float:
    """GB/s reading a 1 GiB tensor with the serving thread count (best of 5)."""
    import torch

    torch.set_num_threads(2)
    data = torch.ones(2**28, dtype=torch.float32)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - start)
    return data.numel() * 4 / best / 1e9


def wait_ready(url: str, process: subprocess.Popen, timeout: float = 900) -> float:
    import httpx

    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if process.poll() is not None:
            raise SystemExit(f"the server exited ({process.returncode})")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return time.monotonic() - start
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit("the server did not come up")


def serve_and_bench(name: str, command: list[str], port: int, args) -> dict:
    import psutil

    url = f"http://127.0.0.1:{port}"
    log = open(os.path.join(args.out, f"{name}.log"), "w")
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    try:
        ready_s = wait_ready(url, process)
        rss_loaded = psutil.Process(process.pid).memory_info().rss
        out = os.path.join(args.out, name)
        subprocess.run([sys.executable, "-m", "pagedllm.cli", "bench", "--base-url", url,
                        "--concurrency", args.concurrency, "--requests", str(args.requests),
                        "--prompt-tokens", "64:256", "--max-tokens", "64", "--out", out],
                       check=True)
        with open(os.path.join(out, "bench.json")) as f:
            levels = {entry["concurrency"]: entry for entry in json.load(f)["levels"]}
        return {"ready_s": ready_s, "rss_loaded": rss_loaded, "levels": levels}
    finally:
        process.terminate()
        process.wait(30)


def server_commands(args) -> dict[str, tuple[list[str], int]]:
    """Each server's command line and port: the same file, parallel slots and threads."""
    return {
        "pagedllm": ([sys.executable, "-m", "pagedllm.cli", "serve", "--model", args.model,
                      "--port", "8011", "--max-num-seqs", str(args.max_num_seqs),
                      "--kv-cache-memory", args.kv_cache_memory], 8011),
        "llama.cpp": ([args.llama_server, "-m", args.model, "--port", "8012",
                       "-np", str(args.max_num_seqs), "-c", str(args.max_num_seqs * 512),
                       "-t", "2", "-tb", "2"], 8012),
    }


def cmd_run(args) -> None:
    os.makedirs(args.out, exist_ok=True)
    size = os.path.getsize(args.model)
    bandwidth = memory_read_bandwidth()
    commands = server_commands(args)
    ours = serve_and_bench("pagedllm", *commands["pagedllm"], args)
    theirs = serve_and_bench("llama.cpp", *commands["llama.cpp"], args)
    print(f"\nfile {size / 2**30:.2f} GiB; memory read bandwidth {bandwidth:.1f} GB/s (2 threads)")
    print(f"{'server':<10} {'ready s':>8} {'RSS loaded':>11} {'N':>3} {'tok/s':>8} "
          f"{'TTFT p50':>9} {'TPOT p50':>9} {'RSS peak':>9}")
    for name, result in (("pagedllm", ours), ("llama.cpp", theirs)):
        for n, entry in sorted(result["levels"].items()):
            print(f"{name:<10} {result['ready_s']:8.1f} {result['rss_loaded'] / 2**30:10.2f}G "
                  f"{n:>3} {entry['total_tokens_per_s']:8.1f} {entry['ttft_ms']['p50']:8.0f}ms "
                  f"{entry['tpot_ms']['p50']:8.1f}ms {(entry['peak_server_rss_bytes'] or 0) / 2**30:8.2f}G")
    for n in sorted(ours["levels"]):
        a, b = ours["levels"][n], theirs["levels"].get(n)
        if b:
            print(f"N={n}: total tok/s {a['total_tokens_per_s'] / b['total_tokens_per_s']:.2f}x "
                  f"llama.cpp's; TPOT p50 {a['tpot_ms']['p50']:.1f} vs {b['tpot_ms']['p50']:.1f} ms")
    for name, result in (("pagedllm", ours), ("llama.cpp", theirs)):
        one = result["levels"].get(1)
        if one:
            achieved = size / (one["tpot_ms"]["p50"] / 1000) / 1e9
            print(f"{name}: decode at N=1 reads ~{achieved:.1f} GB/s of weights, "
                  f"{achieved / bandwidth:.0%} of the measured bandwidth")


def round_of(url: str, model: str, prompts: list[str], max_tokens: int) -> dict:
    """len(prompts) streaming completions at once, through `pagedllm bench`'s client: median
    TTFT and TPOT (as bench computes it), output tokens/s over the round's wall time."""
    import asyncio

    import httpx

    from pagedllm.tools.bench import stream_completion

    async def all_at_once():
        async with httpx.AsyncClient(base_url=url, timeout=600) as client:
            return await asyncio.gather(*(stream_completion(client, model, p, 0, max_tokens, {})
                                          for p in prompts))

    start = time.perf_counter()
    records = asyncio.run(all_at_once())
    wall = time.perf_counter() - start
    failed = [r.error for r in records if r.error]
    if failed:
        raise SystemExit(f"{url}: {failed[0]}")
    return {"ttft": float(np.median([r.ttft for r in records])),
            "tpot": float(np.median([(r.e2e - r.ttft) / (r.output_tokens - 1) for r in records])),
            "out_tok_s": sum(r.output_tokens for r in records) / wall}


def cmd_paired(args) -> None:
    import httpx

    os.makedirs(args.out, exist_ok=True)
    servers = server_commands(args)
    processes = {}
    try:
        for name, (command, port) in servers.items():  # one at a time: loading is not measured
            log = open(os.path.join(args.out, f"{name}.log"), "w")
            processes[name] = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
            wait_ready(f"http://127.0.0.1:{port}", processes[name])
        models = {name: httpx.get(f"http://127.0.0.1:{port}/v1/models").json()["data"][0]["id"]
                  for name, (_, port) in servers.items()}
        rng = np.random.default_rng(0)
        words = ["alpha", "river", "stone", "light", "number", "garden", "seven", "paper"]
        for n in [int(c) for c in args.concurrency.split(",")]:
            rounds = {name: [] for name in servers}
            for r in range(args.rounds + 1):  # round 0 warms both up and is not counted
                prompts = [" ".join(rng.choice(words, size=int(rng.integers(64, 256))))
                           for _ in range(n)]
                order = list(servers) if r % 2 else list(reversed(servers))
                for name in order:
                    result = round_of(f"http://127.0.0.1:{servers[name][1]}", models[name], prompts, 64)
                    if r:
                        rounds[name].append(result)
            ours, theirs = rounds["pagedllm"], rounds["llama.cpp"]
            tpot_ratio = np.median([a["tpot"] / b["tpot"] for a, b in zip(ours, theirs)])
            ttft_ratio = np.median([a["ttft"] / b["ttft"] for a, b in zip(ours, theirs)])
            speed_ratio = np.median([a["out_tok_s"] / b["out_tok_s"] for a, b in zip(ours, theirs)])
            for name, result in rounds.items():
                print(f"N={n} {name:<10} TTFT median {np.median([x['ttft'] for x in result]) * 1e3:7.1f} ms"
                      f"  TPOT median {np.median([x['tpot'] for x in result]) * 1e3:6.1f} ms"
                      f"  output tok/s median {np.median([x['out_tok_s'] for x in result]):6.1f}")
            print(f"N={n} pagedllm / llama.cpp over {args.rounds} paired rounds (median of ratios): "
                  f"TTFT {ttft_ratio:.3f}x, TPOT {tpot_ratio:.3f}x, output tok/s {speed_ratio:.3f}x")
            if n == 1:  # decode reads every weight once a token: how close to the bandwidth
                bandwidth, size = memory_read_bandwidth(), os.path.getsize(args.model)
                for name, result in rounds.items():
                    achieved = size / np.median([x["tpot"] for x in result]) / 1e9
                    print(f"N=1 {name}: ~{achieved:.1f} GB/s of weights read a token, "
                          f"{achieved / bandwidth:.0%} of the {bandwidth:.1f} GB/s measured now")
    finally:
        for process in processes.values():
            process.terminate()
            process.wait(30)


def cmd_load(args) -> None:
    import resource

    import psutil
    import torch

    from pagedllm import LLM

    torch.set_num_threads(2)
    start = time.perf_counter()
    llm = LLM(args.model, dtype="bfloat16", kv_cache_memory=256 << 20, max_num_seqs=8)
    loaded_s = time.perf_counter() - start
    rss = psutil.Process().memory_info().rss
    high_water = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    model = llm.engine.runner.model
    hidden = torch.randn(1, model.config.hidden_size).bfloat16()
    inner = torch.randn(1, model.config.intermediate_size).bfloat16()

    def weights_pass() -> None:
        for layer in model.layers:
            layer.self_attn.qkv_proj(hidden)
            layer.self_attn.o_proj(hidden)
            layer.mlp.gate_up_proj(hidden)
            layer.mlp.down_proj(inner)
        model.head(hidden)

    for _ in range(3):
        weights_pass()
    best = float("inf")
    for _ in range(5):
        begin = time.perf_counter()
        for _ in range(10):
            weights_pass()
        best = min(best, (time.perf_counter() - begin) / 10)
    bandwidth = memory_read_bandwidth()
    print(f"file {os.path.getsize(args.model) / 2**30:.2f} GiB; loaded in {loaded_s:.1f} s; "
          f"resident {rss / 2**30:.2f} GiB (KV pool 0.25 GiB), high-water {high_water / 2**30:.2f} GiB")
    print(f"projections + head at one row, all layers: {best * 1e3:.1f} ms; memory read "
          f"bandwidth {bandwidth:.1f} GB/s")


# --smoke: llama.cpp is not installed where the suite runs, so a stand-in takes its command
# line and serves the file with pagedllm (the script's whole path runs; no figure means anything).
LLAMA_SERVER_STAND_IN = """#!{python}
import argparse, os, sys
parser = argparse.ArgumentParser()
for flag in ("-m", "--port", "-np", "-c", "-t", "-tb"):
    parser.add_argument(flag)
args = parser.parse_args()
os.execv(sys.executable, [sys.executable, "-m", "pagedllm.cli", "serve", "--model", args.m,
                          "--port", args.port, "--max-num-seqs", args.np, "--threads", args.t])
"""
TINY_SHAPE = dict(hidden=256, layers=2, heads=4, kv_heads=4, intermediate=512, context=2048,
                  rope_theta=10000.0)


def smoke() -> None:
    """Every command at tiny sizes: a small random file written and loaded; both servers'
    loads with the default model, the stand-in in llama.cpp's place."""
    import tempfile

    from pagedllm.weights import default_model_path

    out = tempfile.mkdtemp(prefix="pagedllm-realistic-")
    tiny = os.path.join(out, "tiny-random-Q4_0.gguf")
    write_random_q4_0(tiny, TINY_SHAPE)
    cmd_load(argparse.Namespace(model=tiny))
    stand_in = os.path.join(out, "llama-server")
    with open(stand_in, "w") as f:
        f.write(LLAMA_SERVER_STAND_IN.format(python=sys.executable))
    os.chmod(stand_in, 0o755)
    both = dict(model=default_model_path(), llama_server=stand_in, concurrency="1",
                max_num_seqs=2, kv_cache_memory="64MiB", out=out)
    cmd_run(argparse.Namespace(requests=2, **both))
    cmd_paired(argparse.Namespace(rounds=1, **both))


def main() -> None:
    if "--smoke" in sys.argv:
        smoke()
        return
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command", required=True)
    make = sub.add_parser("make")
    make.add_argument("--llama-quantize", required=True)
    make.add_argument("--out", default="bench-results/realistic")
    for name in ("run", "paired"):  # both servers under a load
        both = sub.add_parser(name)
        both.add_argument("--model", required=True)
        both.add_argument("--llama-server", required=True)
        both.add_argument("--concurrency", default="1,8")
        both.add_argument("--max-num-seqs", type=int, default=8)
        both.add_argument("--kv-cache-memory", default="1GiB")
        both.add_argument("--out", default="bench-results/realistic")
        if name == "run":
            both.add_argument("--requests", type=int, default=16)
        else:
            both.add_argument("--rounds", type=int, default=12)
    load = sub.add_parser("load")
    load.add_argument("--model", required=True)
    args = parser.parse_args()
    {"make": cmd_make, "run": cmd_run, "paired": cmd_paired, "load": cmd_load}[args.command](args)


if __name__ == "__main__":
    main()
