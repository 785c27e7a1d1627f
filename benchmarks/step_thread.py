"""Why overlapped steps make no second thread on a CPU (engine/overlap.py): one decode step's
model call timed on the engine's thread, then on a second thread (where a model call would
run beside the host's work), then on the engine's thread again, in one run.

    .venv/bin/python benchmarks/step_thread.py [--model PATH] [--dtype bfloat16] [--calls 100]

Each thread that starts OpenMP parallel regions (torch's and the C++ kernels') gets a team of
its own; prints ms per call for each phase and the ratio of the second thread's to the
first phase's.
"""
from __future__ import annotations

import argparse
import time
from concurrent.futures import ThreadPoolExecutor
from timing import add_smoke, smoke_or


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="GGUF file or folder (default: the default model)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--calls", type=int, default=100)
    add_smoke(parser)
    args = parser.parse_args()
    args.calls = smoke_or(args.calls, 2)
    import torch

    from pagedllm import LLM, SamplingParams
    from pagedllm.engine.launched_step import LaunchedStep

    engine = LLM(args.model, dtype=args.dtype, max_model_len=1024).engine
    engine.add_request("r", "Tell me about the sea.", SamplingParams(max_tokens=8, temperature=0))
    engine.step()
    plan = engine.scheduler.schedule()  # one decode step, computed again and again
    runner = engine.runner

    def calls() -> float:
        start = time.perf_counter()
        for _ in range(args.calls):
            runner._forward(plan, None, LaunchedStep(plan))
        return 1000 * (time.perf_counter() - start) / args.calls

    calls()  # warm-up
    second = ThreadPoolExecutor(1)
    phases = [("engine's thread", calls()), ("second thread", second.submit(calls).result()),
              ("engine's thread again", calls())]
    print(f"{torch.get_num_threads()} threads, {args.dtype}, {args.calls} decode calls a phase")
    for name, ms in phases:
        print(f"{name}: {ms:.2f} ms a call")
    print(f"second thread / engine's thread: {phases[1][1] / phases[0][1]:.2f}x")


if __name__ == "__main__":
    main()
