"""Prefill attention through torch's fused SDPA (oneDNN, on the AMX tiles where the CPU has
them) against pagedllm's tiled C++ kernel, in whole prefills: the engine alone, one process,
the two routes taking turns (each layer's BatchedBackend.prefill_sdpa switched between runs).

    .venv/bin/python benchmarks/prefill_attention.py [--models default,FILE.gguf] [--rounds 5]
        [--lengths 164,300,480]

Per model: the time to first token of one prompt of each length (default 164, 300 and 480
tokens; no prefix cache; a prompt longer than the 256-token step budget takes several steps,
each over the earlier steps' cached keys), median of the rounds, and the ratio SDPA / kernel. The route the
engine takes by default is Backend.prefill_sdpa (backends/cpu.py).
"""
from __future__ import annotations

import argparse
import statistics
import time

from pagedllm.attention.batched import SDPA_MIN_SCORES, BatchedBackend
from pagedllm.core.request import SamplingParams
from pagedllm.engine.engine import LLMEngine
from pagedllm.kernels import capabilities
from timing import add_smoke, smoke_or

LENGTHS = smoke_or((164, 300, 480), (40,))


def ttft_ms(engine: LLMEngine, length: int, seed: int) -> float:
    prompt = [1000 + (seed * 7919 + i * 31) % 30000 for i in range(length)]
    began = time.perf_counter()
    engine.add_request(None, prompt, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    return (time.perf_counter() - began) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="default")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--lengths", default=",".join(map(str, LENGTHS)),
                        help="prompt lengths in tokens, comma-separated")
    add_smoke(parser)
    args = parser.parse_args()
    args.rounds = smoke_or(args.rounds, 1)
    lengths = [int(n) for n in args.lengths.split(",")]
    if not lengths or min(lengths) < 1:
        parser.error("--lengths: positive token counts")
    print(f"CPU kernels: {capabilities().summary}")
    for model in args.models.split(","):
        engine = LLMEngine(None if model == "default" else model, dtype="bfloat16",
                           kv_cache_memory=smoke_or(1 << 30, 64 << 20),
                           max_model_len=max(2048, max(lengths) + 1), enable_prefix_caching=False)
        backends = [m.backend for m in engine.runner.model.modules()
                    if isinstance(getattr(m, "backend", None), BatchedBackend)]
        default = backends[0].prefill_sdpa
        ttft_ms(engine, 64, 0)  # warm-up
        times = {(route, n): [] for route in (True, False) for n in lengths}
        for r in range(args.rounds):
            for route in (True, False):
                for b in backends:
                    b.prefill_sdpa = route
                for n in lengths:
                    times[route, n].append(ttft_ms(engine, n, r * 10 + n))
        print(f"{model} (default route: {'SDPA from' if default else 'kernel at'} "
              f"{SDPA_MIN_SCORES} scores), TTFT median of "
              f"{args.rounds}:")
        for n in lengths:
            sdpa, kernel = statistics.median(times[True, n]), statistics.median(times[False, n])
            print(f"  {n} tokens: SDPA {sdpa:.0f} ms, kernel {kernel:.0f} ms ({sdpa / kernel:.2f}x)")


if __name__ == "__main__":
    main()
