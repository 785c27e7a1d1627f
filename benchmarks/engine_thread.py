"""Decode step time with the engine loop on the main thread vs on another thread.

    .venv/bin/python benchmarks/engine_thread.py [--dtype bfloat16]

One 400-token prompt, 64 greedy tokens, timed per step, first on a helper thread and then on
the main thread of the same process; prints the ratio. `--built-on-helper`: instead, build
the engine and step it on one helper thread (as a Ray replica does), main thread idle. This is why `pagedllm serve` runs
the engine on the main thread and HTTP on a helper thread.
"""
from __future__ import annotations

import argparse
import threading
import time

from pagedllm.engine.engine import LLMEngine
from pagedllm.core.request import SamplingParams
from pagedllm.tools.text_prompts import make_prompt_token_ids
from timing import add_smoke, smoke_or


def decode_ms_per_step(engine: LLMEngine, prompt: list[int], result: list) -> None:
    engine.add_request(None, prompt, SamplingParams(max_tokens=smoke_or(64, 3), ignore_eos=True,
                                                    temperature=0))
    engine.step()  # prefill
    start, steps = time.perf_counter(), 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    result.append((time.perf_counter() - start) / steps * 1000)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--built-on-helper", action="store_true")
    add_smoke(parser)
    args = parser.parse_args()
    if args.built_on_helper:
        result: list = []

        def build_and_step():
            engine = LLMEngine(None, dtype=args.dtype, kv_cache_memory=256 << 20)
            prompt = make_prompt_token_ids(engine.tokenizer, [smoke_or(400, 24)], seed=0)[0]
            decode_ms_per_step(engine, prompt, [])  # warm-up
            decode_ms_per_step(engine, prompt, result)

        worker = threading.Thread(target=build_and_step)
        worker.start()
        worker.join()
        print(f"dtype={args.dtype}: built and stepped on a helper thread {result[0]:.1f} ms/step")
        return
    engine = LLMEngine(None, dtype=args.dtype, kv_cache_memory=256 << 20)
    prompt = make_prompt_token_ids(engine.tokenizer, [smoke_or(400, 24)], seed=0)[0]
    decode_ms_per_step(engine, prompt, [])  # warm-up
    on_thread: list = []
    worker = threading.Thread(target=decode_ms_per_step, args=(engine, prompt, on_thread))
    worker.start()
    worker.join()
    on_main: list = []
    decode_ms_per_step(engine, prompt, on_main)
    print(f"dtype={args.dtype}: helper thread {on_thread[0]:.1f} ms/step, main thread "
          f"{on_main[0]:.1f} ms/step; ratio {on_thread[0] / on_main[0]:.2f}x")


if __name__ == "__main__":
    main()
