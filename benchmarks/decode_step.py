"""Decode step time of the engine at batch 1, 8 and 16: the Python layers with the torch
reference ops, the Python layers with the fused C++ layer ops (which replaced ~40 small
torch calls per layer), and the C++ loop over all layers (models/decode_loop.py).

    .venv/bin/python benchmarks/decode_step.py [--threads 2]

bfloat16, default model, each sequence with a 600-token context; the same engine and KV
cache for all variants, which only swap the layers' `ops` and the model's `decode_loop`.
"""
from __future__ import annotations

import time

from pagedllm import LLM, SamplingParams
from pagedllm.kernels import kernel_ops
from pagedllm.backends.torch_layer_ops import TorchLayerOps
from pagedllm.tools.text_prompts import make_prompt_token_ids
from timing import parse_args, smoke_or


def set_ops(model, ops) -> None:
    for module in model.modules():
        if hasattr(module, "ops"):
            module.ops = ops


def main() -> None:
    args = parse_args()
    context, steps = smoke_or((600, 40), (24, 2))
    print(f"threads={args.threads}, bfloat16, {context}-token contexts; ms per decode step")
    print("batch   torch ops   fused C++ ops   C++ layer loop   fused/torch   loop/fused")
    for batch in smoke_or((1, 8, 16), (1, 2)):
        llm = LLM(dtype="bfloat16", max_num_seqs=batch, kv_cache_memory=512 << 20,
                  enable_prefix_caching=False)
        engine, model = llm.engine, llm.engine.runner.model
        for i, ids in enumerate(make_prompt_token_ids(llm.tokenizer, [context] * batch, seed=1)):
            engine.add_request(str(i), ids, SamplingParams(max_tokens=400, temperature=0, ignore_eos=True))
        while any(r.num_computed_tokens < context for r in engine.scheduler.requests.values()):
            engine.step()
        results = {}
        loop = model.decode_loop
        for name, ops, decode_loop in (("torch", TorchLayerOps, None), ("fused", kernel_ops(), None),
                                       ("loop", kernel_ops(), loop)):
            set_ops(model, ops)
            model.decode_loop = decode_loop
            for _ in range(3):
                engine.step()
            start = time.perf_counter()
            for _ in range(steps):
                engine.step()
            results[name] = (time.perf_counter() - start) / steps * 1e3
        print(f"{batch:>5}   {results['torch']:9.2f}   {results['fused']:13.2f}   {results['loop']:14.2f}"
              f"   {results['torch'] / results['fused']:10.2f}x   {results['fused'] / results['loop']:9.2f}x")


if __name__ == "__main__":
    main()
