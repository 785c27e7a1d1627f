"""Shared by the micro-benchmarks here: milliseconds per call of a function."""
from __future__ import annotations

import time


def ms_per_call(fn, repeat: int = 20) -> float:
    """One warm-up call (first-touch allocations, lazy init), then the mean of `repeat`."""
    fn()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - start) / repeat * 1e3
