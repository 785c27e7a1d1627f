"""Offline batched throughput of the 8 prompts of offline_batching.py, for A/B runs between
commits: run it alternately in this checkout and in a worktree of the other commit (its
`src` first on PYTHONPATH); it uses only `LLM`, `SamplingParams` and `generate`, which every
commit since the offline API has.

    git worktree add /tmp/before d438f99
    for i in 1 2 3; do
      .venv/bin/python benchmarks/offline_throughput.py
      PYTHONPATH=/tmp/before/src .venv/bin/python benchmarks/offline_throughput.py
    done

Prints which checkout it ran and the median of 3 batched runs in tokens/s (prompt + output).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import pagedllm
from pagedllm import LLM, SamplingParams
from pagedllm.tools.text_prompts import make_prompt_token_ids
from timing import add_smoke, smoke_or

LENGTHS = [30, 600, 75, 250, 140, 410, 45, 330]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--runs", type=int, default=3)
    add_smoke(parser)
    args = parser.parse_args()
    lengths = smoke_or(LENGTHS, [16, 24])
    args.max_tokens, args.runs = smoke_or((args.max_tokens, args.runs), (4, 1))
    torch.set_num_threads(args.threads)
    llm = LLM(dtype=args.dtype, enable_prefix_caching=False)
    prompts = make_prompt_token_ids(llm.tokenizer, lengths, seed=0)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(max_tokens=4))  # warm-up
    rates = []
    for _ in range(args.runs):
        start = time.perf_counter()
        llm.generate(prompts, params)
        rates.append((sum(lengths) + len(lengths) * args.max_tokens)
                     / (time.perf_counter() - start))
    print(f"{pagedllm.__file__}: batched {statistics.median(rates):,.0f} tok/s "
          f"(median of {args.runs}; {args.dtype}, {args.threads} threads)")


if __name__ == "__main__":
    main()
