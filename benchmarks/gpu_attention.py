"""The Triton paged attention alone (attention/triton_tiles.py; issue 46), against what bounds
it, measured in the same run:

- decode: N query tokens, each reading its whole context through a scattered block table;
  the bytes the step must read (each KV head's keys and values of every context once) over
  the kernel's time, as a share of the card's copy bandwidth (benchmarks/gpu_decode.py's
  measure). At N=128 with 512- and 1024-token contexts, and N=1 with 8k and 32k.
- prefill: S prompts of T tokens from the start, in one step; tokens/s, and the ratio to
  torch's scaled_dot_product_attention (FlashAttention on a GPU) on the same keys and
  values laid out contiguously (no block table, no paging).

Shapes: SmolLM2-1.7B's attention (32 heads, 32 KV heads, 64 wide) and a grouped one
(Qwen3-1.7B's: 16 heads, 8 KV heads, 128 wide), bfloat16, blocks of 16.

    python benchmarks/gpu_attention.py [--json OUT.json] [--smoke]

--smoke: tiny sizes on the CPU under Triton's interpreter (checks the script, no figures).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

SMOKE = "--smoke" in sys.argv
if SMOKE:  # before Triton is imported
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

from gpu_decode import copy_bandwidth  # noqa: E402

from pagedllm.attention import AttentionMetadata  # noqa: E402
from pagedllm.attention.triton_paged import paged_attention  # noqa: E402

SHAPES = {"smollm2-1.7b": (32, 32, 64), "qwen3-1.7b": (16, 8, 128)}
BLOCK_SIZE = 16


def timed_ms(fn, device: str, repeat: int) -> float:
    """The median of `repeat` calls after two warm-ups (the first compiles)."""
    fn()
    fn()
    times = []
    for _ in range(repeat):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            started = time.perf_counter()
            fn()
            times.append((time.perf_counter() - started) * 1e3)
    return sorted(times)[len(times) // 2]


def paged_step(chunks, heads, kv_heads, head_dim, device, dtype=torch.bfloat16):
    """(query, key cache, value cache, metadata) of a step: chunks are (cached, new) tokens
    per sequence, their blocks scattered through the pool."""
    lengths = [done + new for done, new in chunks]
    need = [-(-n // BLOCK_SIZE) for n in lengths]
    order = torch.randperm(sum(need), generator=torch.Generator().manual_seed(0)).tolist()
    tables, slots, starts = [], [], [0]
    for (done, new), n in zip(chunks, need):
        table = [order.pop() for _ in range(n)]
        tables.append(table)
        slots += [table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(done, done + new)]
        starts.append(starts[-1] + new)
    meta = AttentionMetadata.build(slots, starts, lengths, tables, BLOCK_SIZE)
    make = dict(dtype=dtype, device=device)
    keys = torch.randn(sum(need), BLOCK_SIZE, kv_heads, head_dim, **make)
    values = torch.randn_like(keys)
    query = torch.randn(starts[-1], heads, head_dim, **make)
    return query, keys, values, meta


def decode_case(shape: str, n: int, context: int, device: str, bandwidth, repeat: int) -> dict:
    heads, kv_heads, head_dim = SHAPES[shape]
    query, keys, values, meta = paged_step([(context - 1, 1)] * n, heads, kv_heads, head_dim,
                                           device)
    ms = timed_ms(lambda: paged_attention(query, keys, values, meta, head_dim ** -0.5), device,
                  repeat)
    must_read = n * context * kv_heads * head_dim * 2 * keys.element_size()
    result = {"case": "decode", "shape": shape, "n": n, "context": context, "ms": ms,
              "bytes": must_read, "gb_per_s": must_read / ms / 1e6}
    if bandwidth:
        result["share_of_copy_bandwidth"] = must_read / (ms / 1e3) / bandwidth
    return result


def prefill_case(shape: str, sequences: int, tokens: int, device: str, repeat: int) -> dict:
    heads, kv_heads, head_dim = SHAPES[shape]
    query, keys, values, meta = paged_step([(0, tokens)] * sequences, heads, kv_heads, head_dim,
                                           device)
    ms = timed_ms(lambda: paged_attention(query, keys, values, meta, head_dim ** -0.5), device,
                  repeat)
    # The baseline: the same keys and values, each sequence's contiguous, [S, heads, T, D].
    group = heads // kv_heads

    def contiguous(cache):
        rows = torch.stack([cache[torch.as_tensor(meta.blocks_of(i), device=device)].flatten(0, 1)[:tokens]
                            for i in range(sequences)])
        return rows.repeat_interleave(group, dim=2).transpose(1, 2)
    k, v = contiguous(keys), contiguous(values)
    q = query.view(sequences, tokens, heads, head_dim).transpose(1, 2)
    sdpa_ms = timed_ms(lambda: torch.nn.functional.scaled_dot_product_attention(
        q, k, v, is_causal=True), device, repeat)
    flops = sequences * 4 * heads * head_dim * tokens * (tokens + 1) / 2  # causal QK and PV
    return {"case": "prefill", "shape": shape, "sequences": sequences, "tokens": tokens,
            "ms": ms, "tokens_per_s": sequences * tokens / ms * 1e3,
            "tflop_per_s": flops / ms / 1e9, "sdpa_ms": sdpa_ms,
            "ratio_to_sdpa": ms / sdpa_ms}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()
    device = "cpu" if args.smoke else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("no GPU here: run with --smoke to check the script on the CPU")
        return 2
    bandwidth = copy_bandwidth(device)
    if bandwidth:
        print(f"copy bandwidth: {bandwidth / 1e9:.0f} GB/s", flush=True)
    if args.smoke:
        decode = [(1, 96), (4, 40)]
        prefill = [(2, 40)]
        args.repeat = 1
    else:
        decode = [(128, 512), (128, 1024), (1, 8192), (1, 32768)]
        prefill = [(4, 2048), (16, 512)]
    results = []
    for shape in SHAPES:
        for n, context in decode:
            results.append(decode_case(shape, n, context, device, bandwidth, args.repeat))
        for sequences, tokens in prefill:
            results.append(prefill_case(shape, sequences, tokens, device, args.repeat))
    for r in results:
        if r["case"] == "decode":
            share = r.get("share_of_copy_bandwidth")
            print(f"{r['shape']} decode N={r['n']} ctx={r['context']}: {r['ms']:.3f} ms, "
                  f"{r['gb_per_s']:.0f} GB/s" + (f" = {share:.2f}x copy bandwidth" if share else ""))
        else:
            print(f"{r['shape']} prefill {r['sequences']}x{r['tokens']}: {r['ms']:.3f} ms, "
                  f"{r['tokens_per_s']:.0f} tokens/s, {r['tflop_per_s']:.1f} TFLOP/s, "
                  f"{r['ratio_to_sdpa']:.2f}x torch SDPA's time")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"copy_bandwidth_bytes_per_s": bandwidth, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
