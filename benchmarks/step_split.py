"""Where a step's time goes on the host: the engine alone (no HTTP) at N concurrent
requests, each phase of LLMEngine.step timed per step: planning (Scheduler.schedule), the
model runner's inputs (block tables, slots, metadata), the model call, the head, sampling,
collecting, and applying the outputs (stops, detokenizing, outputs).

By default on the tests' tiny random Qwen3 (a step costs little, so the host's share shows),
float32, one torch thread, 128 output tokens a request. Against an earlier commit, run it with
that commit's `src` first on PYTHONPATH (a worktree) and compare the lines:

    .venv/bin/python benchmarks/step_split.py [--concurrency 256] [--max-tokens 128]
        [--model PATH|default] [--threads 1] [--serve-args "--dtype float32"] [--rounds 2]
"""
from __future__ import annotations

import argparse
import os
import shlex
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))  # tiny_models

from timing import add_smoke  # noqa: E402

PHASES = {  # (class path, method) -> what the line says
    ("pagedllm.core.scheduler", "Scheduler", "schedule"): "plan",
    ("pagedllm.engine.model_runner", "ModelRunner", "_forward"): "inputs+model",
    ("pagedllm.models.llama", "LlamaForCausalLM", "forward"): "model",
    ("pagedllm.models.llama", "LlamaForCausalLM", "compute_logits"): "head",
    ("pagedllm.engine.model_runner", "ModelRunner", "sample"): "sample",
    ("pagedllm.engine.model_runner", "ModelRunner", "collect"): "collect",
    ("pagedllm.engine.engine", "LLMEngine", "_update"): "outputs",
    ("pagedllm.engine.engine", "LLMEngine", "step"): "step",
}


def timed(totals: dict) -> None:
    """Wrap each phase's method so that its wall time adds up in totals[name]."""
    import importlib

    for (module, cls_name, method), name in PHASES.items():
        cls = getattr(importlib.import_module(module), cls_name)
        original = getattr(cls, method)

        def wrapper(*args, _original=original, _name=name, **kwargs):
            start = time.perf_counter()
            try:
                return _original(*args, **kwargs)
            finally:
                totals[_name] = totals.get(_name, 0.0) + time.perf_counter() - start

        setattr(cls, method, wrapper)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--model", default=None)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--serve-args", default="--dtype float32")
    parser.add_argument("--rounds", type=int, default=2)
    add_smoke(parser)
    args = parser.parse_args()
    if args.smoke:
        args.concurrency, args.max_tokens, args.rounds = 2, 4, 1
    import torch

    import host_overhead
    from pagedllm.cli.options import engine_config
    from pagedllm.cli.serve import add_serve_args
    from pagedllm.core.request import SamplingParams
    from pagedllm.engine.engine import LLMEngine

    torch.set_num_threads(args.threads)
    model = host_overhead.model_path(args.model)
    serve = argparse.ArgumentParser()
    add_serve_args(serve)
    engine = LLMEngine(engine_config(serve.parse_args(host_overhead.serve_args(
        model, args.concurrency, shlex.split(args.serve_args)))))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    totals: dict[str, float] = {}
    timed(totals)
    print(f"model {os.path.basename(model)}, {args.threads} thread(s), N={args.concurrency}, "
          f"{args.max_tokens} tokens a request, serve {args.serve_args}", flush=True)
    for round_ in range(args.rounds + 1):  # the first warms up
        totals.clear()
        for i in range(args.concurrency):
            engine.add_request(f"{round_}-{i}", host_overhead.PROMPT, params)
        steps, tokens, start = 0, 0, time.perf_counter()
        while engine.has_unfinished_requests():
            tokens += sum(len(out.new_token_ids) for out in engine.step())
            steps += 1
        wall = time.perf_counter() - start
        if round_ == 0:
            continue
        ms = {name: 1000 * value / steps for name, value in totals.items()}
        ms["inputs"] = ms.pop("inputs+model") - ms["model"] - ms["head"]
        host = ms["step"] - ms["model"] - ms["head"]
        print(f"round {round_}: {tokens / wall:,.0f} tok/s, {steps} steps; ms a step: "
              + ", ".join(f"{name} {ms[name]:.2f}" for name in
                          ("step", "plan", "inputs", "model", "head", "sample", "collect",
                           "outputs"))
              + f"; host (step - model - head) {host:.2f}", flush=True)


if __name__ == "__main__":
    main()
