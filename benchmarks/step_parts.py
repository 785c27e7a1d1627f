"""Where one decode step of one request goes, in the engine: the layers (the C++ decode
loop), the output head, sampling, and the rest (scheduler, metadata, detokenizing, stop
checks), each timed around its own call.

    .venv/bin/python benchmarks/step_parts.py [--model PATH] [--steps 400]

bfloat16, one greedy request decoding; medians over `steps` steps after 20 warm-up steps.
"""
from __future__ import annotations

import argparse
import statistics
import time

from pagedllm import LLM, SamplingParams


def timed(parts: dict, name: str, fn):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            parts[name].append(time.perf_counter() - start)
    return wrapper


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--steps", type=int, default=400)
    args = parser.parse_args()
    llm = LLM(args.model, dtype="bfloat16")
    engine, model = llm.engine, llm.engine.runner.model
    parts = {"layers": [], "head": [], "sampling": []}
    model.forward = timed(parts, "layers", model.forward)
    model.compute_logits = timed(parts, "head", model.compute_logits)
    engine.runner._sample = timed(parts, "sampling", engine.runner._sample)
    engine.add_request(None, "Once upon a time", SamplingParams(
        temperature=0, max_tokens=args.steps + 40, ignore_eos=True))
    for _ in range(20):
        engine.step()
    for values in parts.values():
        values.clear()
    steps = []
    for _ in range(args.steps):
        start = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - start)
    ms = {name: statistics.median(values) * 1000 for name, values in parts.items()}
    step = statistics.median(steps) * 1000
    print(f"step {step:.2f} ms: forward (embedding, layers, norm) {ms['layers']:.2f}, head {ms['head']:.2f}, sampling "
          f"{ms['sampling']:.2f}, the rest {step - sum(ms.values()):.2f}")


if __name__ == "__main__":
    main()
