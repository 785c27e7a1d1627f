"""Where the time goes under load: cProfile of the engine running a bench-like load.

    .venv/bin/python benchmarks/profile_load.py [--budget 256] [--seqs 16] [--threads 2]

32 requests (prompts 128-768 tokens, 128 output tokens), --seqs at a time, bf16, no prefix
caching; prints total tokens/s and the top functions by own time.
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import time

from pagedllm import LLM, SamplingParams
from pagedllm.tools.text_prompts import make_prompt_token_ids
from timing import parse_args, smoke_or


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--budget", type=int, default=256)
    parser.add_argument("--seqs", type=int, default=16)
    parser.add_argument("--top", type=int, default=10, help="functions to list")
    args = parse_args(parser)
    count, shortest, longest, max_tokens = smoke_or((32, 128, 768, 128), (4, 16, 48, 8))
    llm = LLM(dtype="bfloat16", max_num_seqs=args.seqs,
              kv_cache_memory=smoke_or(1 << 30, 128 << 20),
              max_num_batched_tokens=args.budget, enable_prefix_caching=False)
    rng = random.Random(0)
    lengths = [rng.randint(shortest, longest) for _ in range(count)]
    prompts = make_prompt_token_ids(llm.tokenizer, lengths, seed=1)
    llm.generate(prompts[:2], SamplingParams(max_tokens=4))
    profiler = cProfile.Profile()
    start = time.perf_counter()
    profiler.enable()
    llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    profiler.disable()
    elapsed = time.perf_counter() - start
    print(f"budget {args.budget}: {elapsed:.1f} s, "
          f"{(sum(lengths) + max_tokens * count) / elapsed:.0f} total tok/s")
    pstats.Stats(profiler).sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()
