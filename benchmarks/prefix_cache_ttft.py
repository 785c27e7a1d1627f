"""Time to first token with a shared 1,000-token system prompt, prefix caching on vs off.

    .venv/bin/python benchmarks/prefix_cache_ttft.py [--threads 2] [--dtype bfloat16]

A first request warms the cache; then 5 requests with the same system prompt and different
questions each measure the time from add_request to their first token. Prints the medians
and the ratio, measured in this run.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from pagedllm import LLM, SamplingParams
from pagedllm.tools.text_prompts import make_prompt_token_ids
from timing import add_smoke, smoke_or

QUESTIONS = ["What happened to the river?", "Summarise the committee meeting.",
             "How does a compiler work?", "Why does bread rise?", "Describe the mountain path."]


def ttfts(llm: LLM, system: list[int]) -> list[float]:
    engine = llm.engine
    params = SamplingParams(max_tokens=1, temperature=0)
    llm.generate([system + llm.tokenizer.encode(" Warm up.")], params)
    times = []
    for question in smoke_or(QUESTIONS, QUESTIONS[:2]):
        prompt = system + llm.tokenizer.encode(" " + question)
        start = time.perf_counter()
        engine.add_request(None, prompt, params)
        while not engine.step():
            pass
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="bfloat16")
    add_smoke(parser)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    results = {}
    for caching in (False, True):
        llm = LLM(dtype=args.dtype, enable_prefix_caching=caching, kv_cache_memory=256 << 20)
        system = make_prompt_token_ids(llm.tokenizer, [smoke_or(1000, 64)], seed=7)[0]
        results[caching] = statistics.median(ttfts(llm, system))
        print(f"prefix caching {'on ' if caching else 'off'}: TTFT median {results[caching] * 1000:7.1f} ms")
    print(f"dtype={args.dtype} threads={args.threads}; ratio off/on: {results[False] / results[True]:.1f}x")


if __name__ == "__main__":
    main()
