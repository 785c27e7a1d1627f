"""What `--kv-cache-dtype int8` costs in accuracy and gains in memory and decode speed.

    .venv/bin/python benchmarks/kv_cache_int8.py [--threads 2]

bfloat16 model, its K/V cache in bfloat16 ("auto") or int8 codes with a scale per row:
- tokens the same 512 MiB pool holds;
- decode step time of the engine at 1, 8 and 16 sequences of 600-token contexts (the C++
  loop; attention reads the cache), int8 against auto;
- every position's logits of six real-text prompts (22-600 tokens) against the float32
  model with an exact cache: whole prompt in one step, and one token a step (each token's
  attention then reads the cache written before it).
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

from pagedllm import LLM, SamplingParams
from pagedllm.tools.text_prompts import make_prompt_token_ids
from timing import parse_args, smoke_or

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from paged_helpers import run_paged  # noqa: E402

KV_DTYPES = ("auto", "int8")


def decode_ms(batch: int, kv_cache_dtype: str) -> tuple[float, int]:
    """(ms per decode step, pool capacity in tokens) at `batch` sequences of 600 tokens."""
    llm = LLM(dtype="bfloat16", max_num_seqs=batch, kv_cache_memory=512 << 20,
              enable_prefix_caching=False, kv_cache_dtype=kv_cache_dtype)
    engine = llm.engine
    context, steps = smoke_or((600, 40), (24, 2))
    for i, ids in enumerate(make_prompt_token_ids(llm.tokenizer, [context] * batch, seed=1)):
        engine.add_request(str(i), ids, SamplingParams(max_tokens=400, temperature=0, ignore_eos=True))
    while any(r.num_computed_tokens < context for r in engine.scheduler.requests.values()):
        engine.step()
    for _ in range(3):
        engine.step()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    return (time.perf_counter() - start) / steps * 1e3, engine.capacity_tokens


def main() -> None:
    args = parse_args()
    print(f"threads={args.threads}, bfloat16 model, 512 MiB KV pool")
    print("decode step, 600-token contexts:  auto ms   int8 ms   auto/int8")
    capacity = {}
    for batch in smoke_or((1, 8, 16), (1, 2)):
        (auto, capacity["auto"]), (int8, capacity["int8"]) = (decode_ms(batch, d) for d in KV_DTYPES)
        print(f"  {batch:>2} sequences {auto:22.2f} {int8:9.2f} {auto / int8:10.2f}x")
    print(f"tokens in the pool: auto {capacity['auto']:,}, int8 {capacity['int8']:,} "
          f"({capacity['int8'] / capacity['auto']:.2f}x)")

    exact = LLM(dtype="float32", kv_cache_memory=16 << 20).engine.runner.model
    fast = LLM(dtype="bfloat16", kv_cache_memory=16 << 20)
    tokenizer = fast.tokenizer
    prompts = [tokenizer.encode("Once upon a time, in a small village by the sea, there lived an "
                                "old fisherman. The fisherman's daughter walked to the harbour.")]
    prompts += make_prompt_token_ids(tokenizer, smoke_or([64, 150, 300, 450, 600], [16]), seed=3)
    references = [run_paged(exact, [ids], block_size=16)[0] for ids in prompts]
    print(f"{len(prompts)} prompts, {sum(map(len, prompts))} tokens; against float32 with an exact cache")
    print(f"{'cache':<6} {'steps':<16} {'mean |diff|':>11} {'agreement':>10}")
    for kv_cache_dtype in KV_DTYPES:
        for chunk, steps in ((None, "whole prompt"), (1, "one token each")):
            errors, agree = [], []
            for ids, ref in zip(prompts, references):
                logits = run_paged(fast.engine.runner.model, [ids], block_size=16, chunk=chunk,
                                   kv_cache_dtype=kv_cache_dtype)[0]
                errors.append((logits - ref).abs().mean().item())
                agree.append((logits.argmax(-1) == ref.argmax(-1)).float().mean().item())
            print(f"{kv_cache_dtype:<6} {steps:<16} {sum(errors) / len(errors):11.3f}"
                  f" {sum(agree) / len(agree):10.3f}")


if __name__ == "__main__":
    main()
