"""KV memory actually used by the paged cache against a contiguous reservation per slot.

    .venv/bin/python benchmarks/kv_memory.py [--dtype bfloat16]

16 requests (prompts of 128-768 tokens, 128 output tokens) run together; the peak of KV
blocks in use is compared with what reserving the full context for each of 16 slots would
take (what a contiguous, non-paged cache must do), and with reserving prompt + max_tokens
per request.
"""
from __future__ import annotations

import argparse
import random

import torch

from pagedllm import LLM, SamplingParams
from pagedllm.core import sizing
from pagedllm.units import gib
from pagedllm.tools.text_prompts import make_prompt_token_ids
from timing import add_smoke, smoke_or


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--context", type=int, default=8192)
    add_smoke(parser)
    args = parser.parse_args()
    args.context = smoke_or(args.context, 512)
    torch.set_num_threads(2)
    seqs, shortest, longest, max_tokens = smoke_or((16, 128, 768, 128), (4, 16, 48, 8))
    llm = LLM(dtype=args.dtype, max_num_seqs=seqs, kv_cache_memory=smoke_or(2 << 30, 64 << 20),
              max_model_len=args.context)
    engine = llm.engine
    rng = random.Random(0)
    lengths = [rng.randint(shortest, longest) for _ in range(seqs)]
    for p in make_prompt_token_ids(llm.tokenizer, lengths, seed=3):
        engine.add_request(None, p, SamplingParams(max_tokens=max_tokens, temperature=0,
                                                   ignore_eos=True))
    peak_blocks = 0
    while engine.has_unfinished_requests():
        engine.step()
        peak_blocks = max(peak_blocks, engine.kv_manager.pool.num_used_blocks)
    element = 2 if args.dtype == "bfloat16" else 4
    per_token = sizing.kv_bytes_per_token(engine.model_config, element)
    block = engine.cache_config.block_size
    used = peak_blocks * block * per_token
    full_context = seqs * args.context * per_token
    per_request = sum(n + max_tokens for n in lengths) * per_token
    g = gib
    print(f"dtype={args.dtype}: {per_token} bytes per token; {seqs} requests, {sum(lengths)} "
          f"prompt tokens")
    print(f"paged, peak in use:                        {g(used)} ({peak_blocks} blocks of {block})")
    print(f"contiguous, full {args.context}-token context x {seqs}:  {g(full_context)}  "
          f"({full_context / used:.1f}x more)")
    print(f"contiguous, prompt + max_tokens each:      {g(per_request)}  ({per_request / used:.2f}x)")


if __name__ == "__main__":
    main()
