"""Continuous batching vs one-at-a-time: the same 8 requests through LLM.generate.

    .venv/bin/python benchmarks/offline_batching.py [--dtype float32] [--threads 2]

Prints tokens/s both ways and the ratio, both measured in this run.
"""
from __future__ import annotations

import argparse
import time

import torch

from pagedllm import LLM, SamplingParams
from pagedllm.tools.text_prompts import make_prompt_token_ids
from timing import add_smoke, smoke_or

LENGTHS = [30, 600, 75, 250, 140, 410, 45, 330]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    add_smoke(parser)
    args = parser.parse_args()
    lengths = smoke_or(LENGTHS, [16, 24, 8])
    args.max_tokens = smoke_or(args.max_tokens, 4)
    torch.set_num_threads(args.threads)

    llm = LLM(dtype=args.dtype, enable_prefix_caching=False,
              max_num_batched_tokens=args.max_num_batched_tokens)
    prompts = make_prompt_token_ids(llm.tokenizer, lengths, seed=0)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(max_tokens=4))  # warm-up

    start = time.perf_counter()
    together = llm.generate(prompts, params)
    batched_s = time.perf_counter() - start

    start = time.perf_counter()
    alone = [llm.generate([p], params)[0] for p in prompts]
    sequential_s = time.perf_counter() - start

    same = sum(t.token_ids == a.token_ids for t, a in zip(together, alone))
    if args.dtype == "float32":  # the exact path is batch-invariant; bf16 kernels vary by batch
        assert same == len(prompts)
    out_tokens = sum(len(o.token_ids) for o in together)
    all_tokens = out_tokens + sum(lengths)
    print(f"dtype={args.dtype} threads={args.threads} budget={llm.engine.scheduler_config.max_num_batched_tokens} "
          f"requests={len(prompts)} "
          f"prompt_tokens={sum(lengths)} output_tokens={out_tokens}")
    print(f"one at a time: {sequential_s:6.2f} s  {out_tokens / sequential_s:7.1f} output tok/s  "
          f"{all_tokens / sequential_s:7.1f} total tok/s")
    print(f"all at once:   {batched_s:6.2f} s  {out_tokens / batched_s:7.1f} output tok/s  "
          f"{all_tokens / batched_s:7.1f} total tok/s")
    print(f"ratio (all at once / one at a time): {sequential_s / batched_s:.2f}x; "
          f"identical outputs both ways: {same}/{len(prompts)}")


if __name__ == "__main__":
    main()
