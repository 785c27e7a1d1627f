"""Many fine-tunes from one base: 8 LoRA adapters (rank 16, every projection) served at once
by one `pagedllm serve`, N concurrent streamed requests spread over them, against the base
model alone at the same N on the same server, and against 8 separate servers, one per merged
model (what a team runs without LoRA serving), all in one run. Also the time to load a
rank-16 adapter at run time (POST /v1/load_lora_adapter).

    .venv/bin/python benchmarks/lora.py [--concurrency 16] [--max-tokens 96] [--rounds 2]
        [--skip-merged] [--json OUT.json]

The adapters are peft's, random (init_lora_weights=False) over the bundled model, saved as
PEFT folders; the merged models are peft's merge_and_unload of each, saved as Hugging Face
folders and served in bfloat16 like the base (their weights dense: a merged model has no
4-bit codes). Prints tokens/s of each, their ratios, and the servers' resident memory.
"""
from __future__ import annotations

import argparse
import asyncio
import copy
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))

from host_overhead import PROMPT  # noqa: E402
from realistic_size import wait_ready  # noqa: E402
from timing import add_smoke, smoke_or  # noqa: E402

NUM_ADAPTERS, RANK = smoke_or(8, 2), 16
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapters(folder: str, merged: bool) -> tuple[list[str], list[str]]:
    """NUM_ADAPTERS random PEFT folders and, when asked, each merged into a model folder."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pagedllm.weights import default_model_path

    path = default_model_path()
    # read once (transformers dequantizes the GGUF: ~20 s), copied for each adapter: peft
    # changes the model it is given in place
    base = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(os.path.dirname(path),
                                              gguf_file=os.path.basename(path))
    adapters, models = [], []
    for i in range(NUM_ADAPTERS):
        torch.manual_seed(i)
        model = get_peft_model(copy.deepcopy(base), LoraConfig(r=RANK, lora_alpha=2 * RANK,
                                                  target_modules=TARGETS,
                                                  init_lora_weights=False))
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_" in name:
                    p.normal_(0, 0.01)
        adapter = os.path.join(folder, f"adapter{i}")
        model.save_pretrained(adapter, safe_serialization=True)
        adapters.append(adapter)
        if merged:
            out = os.path.join(folder, f"merged{i}")
            merged_model = model.merge_and_unload()
            # transformers marks a model read from a GGUF as "quantized" and will not save
            # it; the weights are plain float32 here (dequantized on load)
            merged_model.hf_quantizer = None
            if hasattr(merged_model.config, "quantization_config"):
                del merged_model.config.quantization_config
            merged_model.save_pretrained(out, safe_serialization=True)
            tokenizer.save_pretrained(out)
            models.append(out)
    return adapters, models


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(args: list[str]) -> tuple[subprocess.Popen, int]:
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "pagedllm.cli", "serve", "--port",
                                str(port), "--log-level", "warning",
                                "--max-connections-per-client", "0", *args],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_ready(f"http://127.0.0.1:{port}", process)
    return process, port


async def _one(port: int, model: str, max_tokens: int) -> int:
    import httpx

    async with httpx.AsyncClient(timeout=600) as client:
        answer = await client.post(f"http://127.0.0.1:{port}/v1/completions", json={
            "model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True})
        answer.raise_for_status()
        return answer.json()["usage"]["completion_tokens"]


def load_level(targets: list[tuple[int, str]], max_tokens: int) -> float:
    """Every (port, model) request at once; total output tokens/s."""
    async def run():
        return await asyncio.gather(*(_one(port, model, max_tokens) for port, model in targets))

    began = time.perf_counter()
    tokens = asyncio.run(run())
    return sum(tokens) / (time.perf_counter() - began)


def rss(processes) -> int:
    import psutil

    return sum(psutil.Process(p.pid).memory_info().rss for p in processes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--skip-merged", action="store_true")
    parser.add_argument("--json", default=None)
    add_smoke(parser)
    args = parser.parse_args()
    if args.smoke:
        args.concurrency, args.max_tokens, args.rounds = 2, 4, 1
    n = args.concurrency
    folder = tempfile.mkdtemp(prefix="pagedllm-lora-bench-")
    adapters, merged = make_adapters(folder, not args.skip_merged)
    import httpx

    result = {"concurrency": n, "max_tokens": args.max_tokens, "rank": RANK,
              "adapters": NUM_ADAPTERS}
    lora_args = ["--served-model-name", "base", "--max-num-seqs", str(n), "--kv-cache-memory", str(256 << 20),
                 "--max-loras", str(NUM_ADAPTERS), "--max-lora-rank", str(RANK),
                 "--lora", ",".join(f"a{i}={p}" for i, p in enumerate(adapters[:-1]))]
    server, port = start(lora_args)
    try:
        began = time.perf_counter()
        loaded = httpx.post(f"http://127.0.0.1:{port}/v1/load_lora_adapter", timeout=60,
                            json={"lora_name": f"a{NUM_ADAPTERS - 1}", "lora_path": adapters[-1]})
        result["adapter_load_s"] = time.perf_counter() - began
        loaded.raise_for_status()
        load_level([(port, "a0")] * 2, 4)  # warm-up
        base, mixed = [], []
        for _ in range(args.rounds):  # alternated, so a drift in the host hits both alike
            base.append(load_level([(port, "base")] * n, args.max_tokens))
            mixed.append(load_level([(port, f"a{i % NUM_ADAPTERS}") for i in range(n)],
                                    args.max_tokens))
        result.update(base_tok_s=max(base), lora_tok_s=max(mixed),
                      lora_server_rss=rss([server]))
    finally:
        server.terminate()
        server.wait(60)
    print(f"adapter load (rank {RANK}, POST /v1/load_lora_adapter): "
          f"{result['adapter_load_s']:.2f} s")
    print(f"N={n}: base alone {result['base_tok_s']:.0f} tok/s; {NUM_ADAPTERS} adapters mixed "
          f"{result['lora_tok_s']:.0f} tok/s = {result['lora_tok_s'] / result['base_tok_s']:.2f}x "
          f"the base; server {result['lora_server_rss'] / 2**20:.0f} MiB")
    if merged:
        per_server = max(1, n // NUM_ADAPTERS)
        servers = [start(["--model", m, "--max-num-seqs", str(per_server), "--threads", "1",
                          "--kv-cache-memory", str(64 << 20)]) for m in merged]
        try:
            load_level([(port, None) for _, port in servers], 4)  # warm-up
            rates = [load_level([(port, None) for _, port in servers
                                 for _ in range(per_server)], args.max_tokens)
                     for _ in range(args.rounds)]
            result.update(merged_tok_s=max(rates), merged_rss=rss([p for p, _ in servers]))
        finally:
            for process, _ in servers:
                process.terminate()
            for process, _ in servers:
                process.wait(60)
        print(f"{NUM_ADAPTERS} servers of merged models, {per_server} requests each: "
              f"{result['merged_tok_s']:.0f} tok/s, {result['merged_rss'] / 2**20:.0f} MiB; "
              f"LoRA serving {result['lora_tok_s'] / result['merged_tok_s']:.2f}x the "
              f"throughput at {result['lora_server_rss'] / result['merged_rss']:.2f}x the memory")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
