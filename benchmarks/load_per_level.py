"""The same server load at every CPU level this host runs, against the portable level in the
same run: `pagedllm bench --launch` once per level, with PAGEDLLM_CPU_ISA set for the
launched server, then one table with each level's ratio over portable.

    .venv/bin/python benchmarks/load_per_level.py [--concurrency 1,16] [--requests 32]
        [--levels portable,avx2,avx512] [--out bench-results/levels]

The load is the issue's: streaming completions, prompts of 128-768 tokens, 128 output
tokens, N concurrent streams (server: --max-num-seqs 16, bfloat16, 2 threads).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from pagedllm.kernels import ENV_VAR, capabilities
from timing import add_smoke, smoke_or


def run_level(level: str, args) -> dict:
    out = os.path.join(args.out, level)
    cmd = [sys.executable, "-m", "pagedllm.cli", "bench", "--launch", "--launch-args",
           "--max-num-seqs 16", "--concurrency", args.concurrency, "--requests", str(args.requests),
           "--out", out, *smoke_or([], ["--max-tokens", "8", "--warmup", "0",
                                        "--prompt-tokens", "16:32"])]
    subprocess.run(cmd, check=True, env={**os.environ, ENV_VAR: level})
    with open(os.path.join(out, "bench.json")) as f:
        return {entry["concurrency"]: entry for entry in json.load(f)["levels"]}


def main() -> None:
    caps = capabilities()
    parser = argparse.ArgumentParser()
    parser.add_argument("--concurrency", default="1,16")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--levels", default=",".join(caps.available))
    parser.add_argument("--out", default="bench-results/levels")
    add_smoke(parser)
    args = parser.parse_args()
    if args.smoke:
        import tempfile

        args.concurrency, args.requests, args.out = "1", 2, tempfile.mkdtemp()
    levels = [lvl.strip() for lvl in args.levels.split(",") if lvl.strip()]
    results = {level: run_level(level, args) for level in levels}
    flags = sorted(f for f in caps.flags if f.startswith(("avx", "fma", "f16c")))
    print(f"\nCPU runs up to {caps.best}; flags: {' '.join(flags)}")
    print(f"{'level':<9} {'N':>3} {'total tok/s':>12} {'TTFT p50 ms':>12} {'TPOT p50 ms':>12} "
          f"{'RSS peak GB':>12} {'tok/s vs ' + levels[0]:>16}")
    for level in levels:
        for n, entry in sorted(results[level].items()):
            base = results[levels[0]][n]["total_tokens_per_s"]
            rss = (entry["peak_server_rss_bytes"] or 0) / 1e9
            print(f"{level:<9} {n:>3} {entry['total_tokens_per_s']:12.0f} {entry['ttft_ms']['p50']:12.0f} "
                  f"{entry['tpot_ms']['p50']:12.1f} {rss:12.2f} {entry['total_tokens_per_s'] / base:15.2f}x")


if __name__ == "__main__":
    main()
