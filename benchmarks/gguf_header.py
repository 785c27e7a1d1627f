"""Reading a GGUF file's header: pagedllm's reader (weights/gguf_file.py) against the gguf
package's GGUFReader it replaced, on the same file in the same run; then a whole model load
(the engine's parts, bfloat16) and `pagedllm plan` as a user runs them.

    .venv/bin/python benchmarks/gguf_header.py [--model PATH] [--repeat 5]

Both readers run over a warm page cache (the file is read once first), so the figures are
parsing, not disk. Prints ms per read for each and the ratio.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

from pagedllm.weights import default_model_path
from timing import add_smoke, smoke_or


def seconds(fn, repeat: int) -> float:
    """Median wall time of `repeat` calls."""
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None, help="a GGUF file (default: the bundled model)")
    parser.add_argument("--repeat", type=int, default=5)
    add_smoke(parser)
    args = parser.parse_args()
    args.repeat = smoke_or(args.repeat, 1)
    path = args.model or default_model_path()
    with open(path, "rb") as f:  # warm the page cache
        while f.read(1 << 24):
            pass

    from gguf import GGUFReader

    from pagedllm.engine.factory import build_parts, engine_config
    from pagedllm.weights.gguf import read_gguf_header

    def package_header():
        reader = GGUFReader(path)
        return {name: field.contents() for name, field in reader.fields.items()}

    theirs = seconds(package_header, args.repeat)
    ours = seconds(lambda: read_gguf_header(path), args.repeat)
    print(f"header, gguf package's GGUFReader: {theirs * 1e3:8.0f} ms")
    print(f"header, pagedllm (gguf_file.py):   {ours * 1e3:8.0f} ms   ratio {theirs / ours:.1f}x")
    load = seconds(lambda: build_parts(engine_config(path, {"dtype": "bfloat16"})), 1)
    print(f"model load (engine parts, bfloat16): {load:6.2f} s")
    plan = seconds(lambda: subprocess.run([sys.executable, "-m", "pagedllm.cli", "plan", "--model", path],
                                          check=True, capture_output=True), 1)
    print(f"`pagedllm plan` (a new process):      {plan:6.2f} s")


if __name__ == "__main__":
    main()
