"""GPU probe (issue 32): what one eager decode step of the 1.7B-shaped model spends on the
GPU, kernel by kernel (torch.profiler), at N=1 and N=32: how far the step is from its
bandwidth floor and where (launches, GEMMs, attention); a step's wall time beside its
kernels' GPU time says how much of it is gaps between kernels. Needs the model file that
benchmarks/gpu_decode.py writes (its --work folder)."""
import json
import os
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
from pagedllm import LLM, SamplingParams  # noqa: E402
from realistic_size import F16_NAME  # noqa: E402

path = os.path.join(sys.argv[1] if len(sys.argv) > 1 else "/tmp/pagedllm-gpu", F16_NAME)
llm = LLM(path, dtype="bfloat16", device="cuda", max_num_seqs=64, max_model_len=512,
          cuda_graphs=False)  # eager: each kernel its own launch, named in the profile
engine = llm.engine
report = {}
for n in (1, 32):
    for i in range(n):
        engine.add_request(None, [(5 + 7 * i + 3 * j) % 40000 + 5 for j in range(128)],
                           SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    for _ in range(4):  # prefill and a few decode steps first
        engine.step()
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(10):  # unprofiled: the step's wall time, against the kernels' GPU time
        engine.step()
    torch.cuda.synchronize()
    wall_us = (time.perf_counter() - started) * 1e5  # a step's, in us
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            engine.step()
        torch.cuda.synchronize()
    events = prof.key_averages()
    cuda = sorted((e for e in events if e.device_time_total > 0),
                  key=lambda e: -e.device_time_total)
    report[f"N={n}"] = {
        "wall_us_per_step": wall_us,
        "gpu_us_per_step": sum(e.self_device_time_total for e in events) / 10,
        "kernels_per_step": sum(e.count for e in events if e.self_device_time_total > 0) / 10,
        "top": [(e.key[:60], e.count // 10, round(e.self_device_time_total / 10, 1))
                for e in cuda[:14]]}
    while engine.has_unfinished_requests():
        engine.step()
    print(json.dumps({f"N={n}": report[f"N={n}"]}), flush=True)
