"""Two builds of the kernels, one process, paired: a base tree's (a git worktree of an older
commit) against this tree's, at one level, on every 4-bit and Q6_K projection of a model
shape, the two builds taking turns within each repeat so both meet the same moment of a
shared host (Q4_0-style and Q4_K 4-bit weights, and Q6_K). Each build's module name holds a digest of its headers (kernels/build.py), so
both load side by side; where only a .cpp changed the two names are the same and this
tree's build replaces the base's: copy the base's .so aside first and name it with
`--base-module`.

    git worktree add /tmp/base <commit>
    .venv/bin/python benchmarks/kernel_builds.py --base-tree /tmp/base --level avx2 [--threads 2]

Prints per shape, product and row count each build's median, the median of the paired
ratios (base / this tree: above 1.00x this tree is faster) and whether both builds give the
same bits (a kernel's speed-up should not change what it computes).
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import time

import torch

from timing import add_smoke, smoke_or

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Per layer, (out, in) as the engine fuses the projections (qkv, o, gate_up, down), and layers.
SHAPES = {
    "135M": ([(960, 576), (576, 576), (3072, 576), (576, 1536)], 30),
    "1.7B": ([(6144, 2048), (2048, 2048), (16384, 2048), (2048, 8192)], 24),
}
# A Q4_K_M file's Q6_K parts of a 1.7B model: down and v of half the layers.
Q6_SHAPES = [(2048, 8192)] * 12 + [(2048, 2048)] * 12
PRODUCTS = ("q4_i16_gemm", "q4_q8_gemm")


def built_module_file(tree: str, level: str) -> str:
    """Builds (or finds) `tree`'s kernels for `level` in a child process; the .so's path."""
    code = ("import sys; from pagedllm.kernels.build import build; "
            f"m = build({level!r}); print(m.__file__ if m else '')")
    env = {**os.environ, "PYTHONPATH": os.path.join(tree, "src")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True).stdout.strip().splitlines()
    if not out or not out[-1]:
        raise SystemExit(f"{tree}: the {level} kernels did not build")
    return out[-1]


def load(path: str):
    name = os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def four_bit(ops, shape: str, layers: int | None = None) -> list[tuple[torch.Tensor, int]]:
    projections, count = SHAPES[shape]
    gen = torch.Generator().manual_seed(0)
    return [(ops.q4_pack(torch.randint(0, 16, (out, inp), dtype=torch.uint8, generator=gen),
                         torch.rand(out, inp // 32, generator=gen) * 0.01,
                         torch.rand(out, inp // 32, generator=gen) * -0.1), inp)
            for _ in range(layers or count) for out, inp in projections]


def four_bit_k(ops, layers: int | None = None) -> list[tuple[torch.Tensor, int]]:
    """The 1.7B's projections in Q4_K (a Q4_K_M file's other parts: its 6-bit ones are Q6_K)."""
    projections, count = SHAPES["1.7B"]
    gen = torch.Generator().manual_seed(2)
    return [(ops.q4k_pack(torch.randint(0, 16, (out, inp), dtype=torch.uint8, generator=gen),
                          torch.randint(0, 64, (out, inp // 32), dtype=torch.uint8, generator=gen),
                          torch.randint(0, 64, (out, inp // 32), dtype=torch.uint8, generator=gen),
                          (torch.rand(out, inp // 256, generator=gen) * 1e-3).half().float(),
                          (torch.rand(out, inp // 256, generator=gen) * 1e-3).half().float()), inp)
            for _ in range(layers or count) for out, inp in projections]


def six_bit(ops, parts: int | None = None) -> list[tuple[torch.Tensor, int]]:
    gen = torch.Generator().manual_seed(1)
    return [(ops.q6_pack(torch.randint(0, 64, (out, inp), dtype=torch.uint8, generator=gen),
                         torch.randint(-128, 128, (out, inp // 16), dtype=torch.int8, generator=gen),
                         (torch.rand(out, inp // 256, generator=gen) * 1e-3).half()), inp)
            for out, inp in Q6_SHAPES[:parts]]


def paired(base, new, product: str, packed, rows: int, repeats: int) -> tuple[float, float, float, bool]:
    """Medians of each build's time and of the paired ratios base / new, and whether the two
    builds' results are the same bits."""
    inputs = {inp: torch.randn(rows, inp).bfloat16() for _, inp in packed}
    identical = all(torch.equal(getattr(base, product)(inputs[inp], p), getattr(new, product)(inputs[inp], p))
                    for p, inp in packed[:8])

    def seconds(ops) -> float:
        fn = getattr(ops, product)
        start = time.perf_counter()
        for p, inp in packed:
            fn(inputs[inp], p)
        return time.perf_counter() - start

    seconds(base), seconds(new)
    pairs = [(seconds(base), seconds(new)) for _ in range(repeats)]
    return (statistics.median(b for b, _ in pairs), statistics.median(n for _, n in pairs),
            statistics.median(b / n for b, n in pairs), identical)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--base-tree", help="a checkout of the base commit (default: this tree, "
                                            "which compares the build with itself)")
    parser.add_argument("--base-module", help="the base build's .so, where its name would equal "
                                              "this tree's")
    parser.add_argument("--level", help="a kernel level (default: this CPU's best)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", default="1,4,8,16")
    add_smoke(parser)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.level is None:
        from pagedllm.kernels import capabilities

        args.level = capabilities().level
    new = load(built_module_file(ROOT, args.level))
    base = load(args.base_module or built_module_file(args.base_tree or ROOT, args.level))
    repeats = smoke_or(7, 1)
    rows_list = smoke_or([int(r) for r in args.rows.split(",")], [1, 8])
    print(f"level {args.level}, {args.threads} thread(s); base {os.path.basename(base.__file__)}, "
          f"this tree {os.path.basename(new.__file__)}")
    cases = [(shape, product, four_bit(base, shape, smoke_or(None, 1))) for shape in SHAPES
             for product in PRODUCTS]
    cases += [("1.7B Q4_K", product, four_bit_k(base, smoke_or(None, 1))) for product in PRODUCTS]
    cases.append(("1.7B Q6_K", "q6_gemm", six_bit(base, smoke_or(None, 2))))
    for shape, product, packed in cases:
        for rows in rows_list:
            b, n, ratio, identical = paired(base, new, product, packed, rows, repeats)
            print(f"{shape:10s} {product:12s} rows {rows:3d}: base {b * 1e3:8.2f} ms, this tree "
                  f"{n * 1e3:8.2f} ms, speed-up {ratio:.2f}x, same bits: {'yes' if identical else 'NO'}",
                  flush=True)


if __name__ == "__main__":
    main()
