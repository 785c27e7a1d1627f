"""Memory pressure, for admission: when the process's resident memory passes --max-memory
(or, without it, when the machine has less than a tenth of its memory free), new requests
wait instead of the OOM killer ending the server. Running requests go on (their KV blocks
are already in the pool, which never grows past its size). No torch: psutil only."""
from __future__ import annotations

import time

import psutil

MIN_FREE_FRACTION = 0.10  # the default: leave a tenth of the machine free
CHECK_EVERY_SECONDS = 0.25  # reading memory costs a few microseconds; steps run every few ms


class MemoryGuard:
    def __init__(self, max_memory: int | None = None, clock=time.monotonic,
                 read=None):
        """max_memory: bytes of resident memory for this process; None: the machine rule.
        `read` returns (process rss, machine available, machine total) (tests give their own)."""
        self.max_memory = max_memory
        self._clock = clock
        self._read = read or _reader(psutil.Process())
        self._checked_at = float("-inf")
        self._under_pressure = False
        self.reason = ""

    def under_pressure(self) -> bool:
        now = self._clock()
        if now - self._checked_at >= CHECK_EVERY_SECONDS:
            self._checked_at = now
            rss, available, total = self._read()
            if self.max_memory is not None:
                self._under_pressure = rss >= self.max_memory
                self.reason = f"resident memory {rss >> 20} MiB >= --max-memory {self.max_memory >> 20} MiB"
            else:
                self._under_pressure = available < MIN_FREE_FRACTION * total
                self.reason = (f"the machine has {available >> 20} MiB free, under "
                               f"{MIN_FREE_FRACTION:.0%} of {total >> 20} MiB")
        return self._under_pressure


def _reader(process: psutil.Process):
    def read() -> tuple[int, int, int]:
        machine = psutil.virtual_memory()
        return process.memory_info().rss, machine.available, machine.total
    return read
