"""LoRA's cost in the engine alone (no HTTP): N=16 requests decoding at once, the base alone
(with its C++ decode loop, and without it), 8 adapters mixed, and one adapter for all, on the
same engine in one run. The served figures are benchmarks/lora.py's; this one isolates the
step (how BENCHMARKS.md's LoRA progression table was measured, commit by commit).

    .venv/bin/python benchmarks/lora_engine.py [--tokens 48] [--adapters DIR]

DIR: PEFT folders named adapter0..adapter7 (benchmarks/lora.py makes them; by default they
are made here, random rank 16 over every projection). Prints tokens/s of each and the ratio
over the base with its decode loop.
"""
from __future__ import annotations

import argparse
import glob
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))

from timing import add_smoke, smoke_or  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--adapters", default=None)
    add_smoke(parser)
    args = parser.parse_args()
    if args.smoke:
        args.tokens = 4
    folder = args.adapters
    if folder is None:
        from lora import make_adapters

        folder = tempfile.mkdtemp(prefix="pagedllm-lora-engine-")
        make_adapters(folder, merged=False)
    from pagedllm.config import LoRAConfig
    from pagedllm.core.request import SamplingParams
    from pagedllm.engine.engine import LLMEngine

    adapters = tuple((f"a{i}", path) for i, path in
                     enumerate(sorted(glob.glob(os.path.join(folder, "adapter*")))))
    engine = LLMEngine(dtype="bfloat16", kv_cache_memory=256 << 20, max_model_len=1024,
                       max_num_seqs=16, lora=LoRAConfig(adapters=adapters,
                                                        max_loras=len(adapters)))

    def run(models: list, loop: bool = True) -> float:
        """Decode tokens/s of these requests together (after their prefill step)."""
        model = engine.runner.model
        kept = model.decode_loop
        model.decode_loop = kept if loop else None
        try:
            for name in models:
                engine.add_request(None, "Tell me a long story about a lighthouse keeper",
                                   SamplingParams(max_tokens=args.tokens, temperature=0,
                                                  ignore_eos=True, lora=name))
            engine.step()  # the prefill
            began, tokens = time.perf_counter(), 0
            while engine.has_unfinished_requests():
                tokens += sum(len(out.new_token_ids) for out in engine.step())
            return tokens / (time.perf_counter() - began)
        finally:
            model.decode_loop = kept

    n = smoke_or(16, 2)
    run([None] * n)  # warm-up
    base = run([None] * n)
    figures = {"base, C++ decode loop": base,
               "base, Python layers": run([None] * n, loop=False),
               f"{len(adapters)} adapters mixed": run([f"a{i % len(adapters)}" for i in range(n)]),
               "one adapter for all": run(["a0"] * n)}
    for name, rate in figures.items():
        print(f"{name}: {rate:.0f} tok/s = {rate / base:.2f}x the base")


if __name__ == "__main__":
    main()
