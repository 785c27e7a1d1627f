"""Shared by the benchmarks here: the --threads option, milliseconds per call of a function."""
from __future__ import annotations

import argparse
import time

import torch


def parse_args(parser: argparse.ArgumentParser | None = None) -> argparse.Namespace:
    """The script's arguments plus --threads (default 2, this machine's cores), applied to torch."""
    parser = parser or argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    return args


def ms_per_call(fn, repeat: int = 20) -> float:
    """One warm-up call (first-touch allocations, lazy init), then the mean of `repeat`."""
    fn()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - start) / repeat * 1e3
