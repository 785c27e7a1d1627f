"""Shared by the benchmarks here: the --threads and --smoke options, milliseconds per call of
a function.

--smoke: every script runs its whole path once at tiny sizes (a few steps, one repeat), so
the suite can run it and parse what it prints (tests/test_benchmark_scripts.py); its
figures then mean nothing."""
from __future__ import annotations

import argparse
import sys
import time

import torch


# Set by parse_args (or a script's own --smoke) before any size is chosen.
SMOKE = "--smoke" in sys.argv


def add_smoke(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--smoke", action="store_true",
                        help="tiny sizes, one repeat: checks that the script runs (the suite's "
                             "smoke test); the figures mean nothing")


def parse_args(parser: argparse.ArgumentParser | None = None) -> argparse.Namespace:
    """The script's arguments plus --threads (default 2, this machine's cores), applied to
    torch, and --smoke."""
    parser = parser or argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=2)
    add_smoke(parser)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    return args


def smoke_or(full, small):
    """`small` in a smoke run, else `full`."""
    return small if SMOKE else full


def ms_per_call(fn, repeat: int = 20) -> float:
    """One warm-up call (first-touch allocations, lazy init), then the mean of `repeat`."""
    repeat = 1 if SMOKE else repeat
    fn()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - start) / repeat * 1e3


def allocate_as_a_loaded_engine() -> None:
    """Puts glibc's allocator in the state a serving process is in. Freeing a model's
    staging tensors raises glibc's mmap threshold (to 32 MiB at most), so the engine's
    per-step tensors of a few MB come from the heap; a fresh script instead maps and
    page-faults each of them anew, which made the torch gather baseline of
    attention_kernels.py ~5x slower (231.7 against 44.2 ms at S=8) and its ratio depend on
    what the script had freed before."""
    import ctypes

    M_MMAP_THRESHOLD = -3
    try:
        ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, 32 << 20)
    except (OSError, AttributeError):
        pass
