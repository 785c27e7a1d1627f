"""Compile every Triton launch the GPU-path tests made (tests/triton_launches.py records them
under the interpreter) for real NVIDIA cards, on a machine without one: A100 (sm_80), L4/L40S
(sm_89), H100/H200 (sm_90), through Triton's own specialization and its bundled ptxas; each
cubin's registers, local memory (spills) and shared memory read with the bundled cuobjdump.

    python scripts/compile_gpu_kernels.py [build/triton-launches.json] [--archs 80,89,90]
        [--json OUT.json]

Exit 1 when a launch does not compile, when a kernel spills (local memory), or when a kernel
of pagedllm's is neither launched by a test nor called from another kernel. Run it with the
Triton to check first on PYTHONPATH (make test: the pinned one, then the GPU machine's).
"""
from __future__ import annotations

import argparse
import ast
import collections
import glob
import importlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time

# Triton 3.9 warns that its default changes in 3.10; the check compiles what runs today.
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "src"))
DEFAULT_LAUNCHES = os.path.join(ROOT, "build", "triton-launches.json")
RESOURCES = re.compile(r"Function (\S+):\s+REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)")


def argument(value):
    """A stand-in for a recorded argument that Triton specializes the same way."""
    import torch
    import triton.language as tl

    if isinstance(value, dict) and "tensor" in value:
        dtype = getattr(torch, value["tensor"])
        return torch.empty(2, dtype=dtype) if value["aligned"] else torch.empty(3, dtype=dtype)[1:]
    if isinstance(value, dict) and "tl_dtype" in value:
        return tl.dtype(value["tl_dtype"])
    return value


def compile_launch(record: dict, arch: int):
    """The compiled kernel of one recorded launch for sm_<arch>."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    module, name = record["kernel"].split(":")
    fn = getattr(importlib.import_module(module), name)
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    options = dict(record["options"])
    args = {k: argument(v) for k, v in record["args"].items()}
    bound, specialization, parsed = binder(**args, **options)
    parsed, signature, constexprs, attrs = fn._pack_args(backend, options, bound, specialization,
                                                         parsed)
    return triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target,
                          options=parsed.__dict__)


def resources(cubin: bytes) -> dict:
    """REG, STACK, SHARED and LOCAL of the cubin's kernel, from cuobjdump."""
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True,
                             text=True, check=True).stdout
    _, reg, stack, shared, local = RESOURCES.search(out).groups()
    return {"registers": int(reg), "stack": int(stack), "shared": int(shared),
            "local": int(local)}


def kernels_in_source() -> tuple[set[str], set[str]]:
    """Every @triton.jit function of pagedllm ("module:name"), and those called from another."""
    defined, called = set(), set()
    for path in glob.glob(os.path.join(ROOT, "src", "pagedllm", "**", "*.py"), recursive=True):
        with open(path) as f:
            source = f.read()
        if "triton.jit" not in source:
            continue
        module = os.path.relpath(path, os.path.join(ROOT, "src"))[:-3].replace(os.sep, ".")
        tree = ast.parse(source)
        jitted = [node for node in tree.body if isinstance(node, ast.FunctionDef)
                  and any("jit" in ast.unparse(d) for d in node.decorator_list)]
        names = {node.name for node in jitted}
        defined |= {f"{module}:{name}" for name in names}
        for node in jitted:
            called |= {f"{module}:{call.func.id}" for call in ast.walk(node)
                       if isinstance(call, ast.Call) and isinstance(call.func, ast.Name)
                       and call.func.id in names}
        # a helper imported from another kernel module, called by name
        for node in tree.body:
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("pagedllm"):
                called |= {f"{node.module}:{alias.name}" for alias in node.names}
    return defined, called


def compiled_row(record: dict, arch: int) -> dict:
    """One launch on one card: its resources, or why it did not compile."""
    row = {"kernel": record["kernel"], "arch": arch,
           "constexprs": {k: v for k, v in record["args"].items() if k.isupper()}}
    try:
        return row | resources(compile_launch(record, arch).asm["cubin"])
    except Exception as exc:  # noqa: BLE001 - every failure is reported, then exit 1
        last = (str(exc).strip().splitlines() or [""])[-1]
        return row | {"error": f"{type(exc).__name__}: {last}", "launch": record}


def check(records: list[dict], archs: list[int], workers: int = 0
          ) -> tuple[list[dict], list[str]]:
    """(one row per launch and card, the failures); compiled in `workers` processes."""
    from concurrent.futures import ProcessPoolExecutor

    jobs = [(record, arch) for record in records for arch in archs]
    with ProcessPoolExecutor(workers or os.cpu_count() or 1) as pool:
        rows = list(pool.map(compiled_row, *zip(*jobs))) if jobs else []
    failures = []
    for row in rows:
        where = f"{row['kernel']} sm_{row['arch']}"
        if "error" in row:
            failures.append(f"{where} does not compile: {row['error']} "
                            f"(launch: {json.dumps(row['launch'])})")
        elif row["local"]:
            failures.append(f"{where} spills: {row['local']} bytes of local memory "
                            f"({json.dumps(row['constexprs'])})")
    defined, called = kernels_in_source()
    launched = {r["kernel"] for r in records}
    failures += [f"{kernel} is launched by no test (a kernel no CPU test runs is first compiled "
                 f"on a lent card)" for kernel in sorted(defined - launched - called)]
    return rows, failures


def summary(rows: list[dict]) -> list[str]:
    by_kernel = collections.defaultdict(list)
    for row in rows:
        by_kernel[row["kernel"]].append(row)
    lines = [f"{'kernel':<58} {'launches':>8} {'max regs':>8} {'max shared':>10} {'spills':>6}"]
    for kernel, kernel_rows in sorted(by_kernel.items()):
        ok = [r for r in kernel_rows if "error" not in r]
        lines.append(f"{kernel:<58} {len(kernel_rows):>8} "
                     f"{max((r['registers'] for r in ok), default=0):>8} "
                     f"{max((r['shared'] for r in ok), default=0):>10} "
                     f"{sum(1 for r in ok if r['local']):>6}")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("launches", nargs="?", default=DEFAULT_LAUNCHES)
    parser.add_argument("--archs", default="80,89,90")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    import triton

    if not os.path.exists(args.launches):
        print(f"{args.launches}: no launches recorded (run the test suite first)")
        return 1
    with open(args.launches) as f:
        records = json.load(f)
    archs = [int(a) for a in args.archs.split(",")]
    began = time.perf_counter()
    rows, failures = check(records, archs)
    print(f"Triton {triton.__version__}: {len(records)} launches x sm_{', sm_'.join(map(str, archs))}"
          f" compiled in {time.perf_counter() - began:.0f} s")
    print("\n".join(summary(rows)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"triton": triton.__version__, "rows": rows, "failures": failures}, f,
                      indent=1)
    for failure in failures:
        print("FAIL:", failure)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
