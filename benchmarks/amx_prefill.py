"""AMX tiles for the steps with many rows (issue 49): the engine alone (LLMEngine in a child
process per setting, nothing else running), with the tiles (this CPU's default where it has
them) against PAGEDLLM_CPU_AMX=0 (pagedllm's own avx512 4-bit kernels), alternated, in one run.

    .venv/bin/python benchmarks/amx_prefill.py [--models default,1.7b,FILE.gguf] [--rounds 2] [--json OUT]
    .venv/bin/python benchmarks/amx_prefill.py --switch int16   # 16-bit activations on and off
    .venv/bin/python benchmarks/amx_prefill.py --projections   # one matrix of each shape
    .venv/bin/python benchmarks/amx_prefill.py --rows          # the exact product by row count

Per model: the time to first token of one prompt of 164 and of 480 tokens (prefill alone,
no prefix cache; best of 3 in each round), and N=8 prompts of 164 tokens with 32 output
tokens each (total tok/s: prefills and batched decode steps), and the time per output token
of one request alone (64 tokens after a 16-token prompt). The 1.7B model is SmolLM2-1.7B's
shape with random Q4_0 weights (benchmarks/realistic_size.py writes it, once, into the temp
folder); a path to a GGUF file names any other (realistic_size.py make: the Q4_K_M one).
Prints each figure with the tiles and without, and their ratio.

--rows: one 16384 x 2048 Q4_K matrix (the 1.7B's gate/up) at 1 to 127 activation rows, ~400 MB
of copies so that each product streams from memory: the exact product on the tiles
(q4_gemm amx=True), the AVX-512 exact tile, the 16-bit integer activations (q4_i16_gemm) and
the int8-activation kernel.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))

from timing import SMOKE, add_smoke  # noqa: E402

CHILD = r"""
import json, sys, time
from pagedllm.core.request import SamplingParams
from pagedllm.engine.engine import LLMEngine
engine = LLMEngine(sys.argv[1] or None, dtype="bfloat16", kv_cache_memory=1 << 30,
                   max_model_len=2048, max_num_seqs=8, enable_prefix_caching=False)

def run(prompts, max_tokens):
    for i, prompt in enumerate(prompts):
        engine.add_request(None, prompt, SamplingParams(max_tokens=max_tokens, temperature=0,
                                                        ignore_eos=True))
    start, tokens = time.perf_counter(), 0
    while engine.has_unfinished_requests():
        tokens += sum(len(o.new_token_ids) for o in engine.step())
    return time.perf_counter() - start, tokens

prompt = lambda n, seed: [1000 + (seed * 7919 + i * 31) % 30000 for i in range(n)]
smoke = sys.argv[2:] == ["--smoke"]
short, long, tries, decoded = (24, 40, 1, 5) if smoke else (164, 480, 3, 65)
run([prompt(64, 0)], 1)  # warm-up
out = {"level": engine.cpu.summary}
for n in (short, long):
    out[f"ttft_{n}_ms"] = 1000 * min(run([prompt(n, s)], 1)[0] for s in range(1, 1 + tries))
seconds, tokens = run([prompt(short, 10 + i) for i in range(8)], 32 if not smoke else 4)
out["n8_tok_s"] = tokens / seconds
first = min(run([prompt(16, 20 + s)], 1)[0] for s in range(tries))
out["tpot_n1_ms"] = 1000 * (min(run([prompt(16, 30 + s)], decoded)[0]
                                for s in range(tries)) - first) / (decoded - 1)
print(json.dumps(out))
"""


# --switch: the setting compared, on against off (kernels/cpu.py).
SWITCHES = {"amx": "PAGEDLLM_CPU_AMX", "int16": "PAGEDLLM_CPU_INT16"}


def measure(model: str, on: bool, switch: str = "amx") -> dict:
    env = {**os.environ, SWITCHES[switch]: "1" if on else "0"}
    done = subprocess.run([sys.executable, "-c", CHILD, model, *(["--smoke"] if SMOKE else [])],
                          env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def projections() -> None:
    """One random 4-bit matrix of each of the 1.7B and 135M shapes' projections, 64, 164 and
    512 rows: the exact and int8-activation kernels against dequantize + oneDNN and the fused
    product on the tiles (q4_bf16_gemm)."""
    import torch

    from pagedllm.kernels import capabilities, kernels_for
    from pagedllm.weights.q4 import Q4Weight

    ops = kernels_for(capabilities().level)

    def best_ms(fn, repeats=5):
        fn()
        began = time.perf_counter()
        for _ in range(repeats):
            fn()
        return (time.perf_counter() - began) / repeats * 1000

    for n, k in [(3072, 2048), (16384, 2048), (2048, 8192), (960, 576), (3072, 576)]:
        g = torch.Generator().manual_seed(0)
        d = (torch.rand(n, k // 32, generator=g) * 0.01).half().float()
        packed = Q4Weight(torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8), d,
                          -8 * d).kernel_pack(ops)
        buffer = torch.empty(k, n, dtype=torch.bfloat16)
        dequantize = best_ms(lambda: ops.lowbit_dequantize(packed, k, buffer))
        for rows in (64, 164, 512):
            x = torch.randn(rows, k).to(torch.bfloat16)
            exact = best_ms(lambda: ops.q4_gemm(x, packed))
            int8 = best_ms(lambda: ops.q4_q8_gemm(x, packed))
            tiles = best_ms(lambda: torch.matmul(x, ops.lowbit_dequantize(packed, k, buffer)))
            fused = best_ms(lambda: ops.q4_bf16_gemm(x, packed))
            print(f"{n} x {k}, {rows} rows: exact {exact:.2f} ms, int8 {int8:.2f} ms, "
                  f"dequantize + oneDNN {tiles:.2f} ms (dequantizing alone {dequantize:.2f}), "
                  f"fused on the tiles {fused:.2f} ms")


def rows_table() -> None:
    import statistics

    import torch

    from pagedllm.kernels import capabilities, kernels_for

    ops = kernels_for("avx512")
    print(f"{capabilities().summary}, tiles usable: {ops.amx_tiles_usable()}, "
          f"{torch.get_num_threads()} threads")
    g = torch.Generator().manual_seed(0)
    n, k = 16384, 2048
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g)
    scales = torch.randint(0, 64, (n, k // 32), dtype=torch.uint8, generator=g)
    d = (torch.rand(n, k // 256, generator=g) * 1e-3).half().float()
    mats = [ops.q4k_pack(codes, scales, scales, d, d) for _ in range(max(2, (400 << 20) // (n * k)))]
    for rows in (1, 2, 3, 4, 8, 16, 32, 64, 127):
        x = torch.randn(rows, k).bfloat16()
        kernels = {"tiles": lambda m: ops.q4_gemm(x, m, amx=True), "avx512 exact": ops.q4_gemm,
                   "int16": ops.q4_i16_gemm, "int8": ops.q4_q8_gemm}
        times = {name: [] for name in kernels}
        for _ in range(7):  # the kernels take turns, so each meets the same moments of the host
            for name, fn in kernels.items():
                began = time.perf_counter()
                for m in mats:
                    fn(x, m) if name != "tiles" else fn(m)
                times[name].append((time.perf_counter() - began) / len(mats) * 1000)
        ms = {name: statistics.median(t) for name, t in times.items()}
        print(f"{rows:4d} rows: " + ", ".join(f"{name} {v:.3f} ms" for name, v in ms.items())
              + f"; tiles / avx512 exact {ms['tiles'] / ms['avx512 exact']:.2f}x"
              + f", int16 / avx512 exact {ms['int16'] / ms['avx512 exact']:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="default,1.7b")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", default=None)
    parser.add_argument("--projections", action="store_true",
                        help="time one matrix of each shape instead (this process)")
    parser.add_argument("--rows", action="store_true",
                        help="the exact product by row count instead (this process)")
    parser.add_argument("--switch", choices=sorted(SWITCHES), default="amx",
                        help="what is compared on against off: the AMX tiles (PAGEDLLM_CPU_AMX) or "
                             "the 16-bit integer activations (PAGEDLLM_CPU_INT16)")
    add_smoke(parser)
    args = parser.parse_args()
    if args.smoke:
        args.models, args.rounds = "default", 1
    if args.projections:
        projections()
        return
    if args.rows:
        rows_table()
        return
    results = {}
    for name in args.models.split(","):
        path = name if name.endswith(".gguf") else ""
        if name == "1.7b":
            from realistic_size import write_random_q4_0

            path = os.path.join(tempfile.gettempdir(), "pagedllm-amx-1.7b-random-Q4_0.gguf")
            if not os.path.exists(path):
                write_random_q4_0(path)
        runs = {True: [], False: []}
        for _ in range(args.rounds):
            for on in (True, False):
                runs[on].append(measure(path, on, args.switch))
        # times: the least; rates: the most
        best = {on: {key: (min if key.endswith("_ms") else max)(r[key] for r in rs)
                     for key in rs[0] if key != "level"} | {"level": rs[0]["level"]}
                for on, rs in runs.items()}
        results[name] = {"switch": args.switch, "on": best[True], "off": best[False]}
        print(f"{name}: {best[True]['level']} against {best[False]['level']}, "
              f"{SWITCHES[args.switch]}=1 against =0")
        for key in best[True]:
            if key == "level":
                continue
            on, off = best[True][key], best[False][key]
            print(f"  {key}: {on:.1f} on, {off:.1f} off: {on / off:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
