"""Noticing an engine process that stopped making progress (a kernel spinning for ever, a
SIGSTOP, a swapped-out machine) while requests wait on it (serving/process_client.py).

A busy engine process is heard from at least once a second (each step's outputs, or a
heartbeat: serving/core_process.py), so silence while requests are in flight is the sign,
not a guess from load. After `stall_after` seconds of it the engine counts as stalled: the
log says so once, /health and new requests get 503 `engine_stalled` saying for how long;
after `restart_after` the front end kills it, and the keeper restarts it as after a crash.
"""
from __future__ import annotations

import logging
import time

logger = logging.getLogger("pagedllm.server")
STALL_AFTER_S = 30.0
RESTART_AFTER_S = 180.0  # a very slow but sound step (a big model's prefill) is never cut


class StallWatch:
    def __init__(self, stall_after: float = STALL_AFTER_S,
                 restart_after: float = RESTART_AFTER_S):
        self.stall_after, self.restart_after = stall_after, restart_after
        self.last_heard = time.monotonic()
        self.stalled_since: float | None = None

    def heard(self) -> None:
        """The engine said something (or nothing waits on it): it is making progress."""
        if self.stalled_since is not None:
            logger.warning("the engine process makes progress again after %.0f s",
                           time.monotonic() - self.stalled_since)
        self.last_heard = time.monotonic()
        self.stalled_since = None

    def reset(self) -> None:
        """A new engine process (or none yet): nothing to hold against it."""
        self.last_heard = time.monotonic()
        self.stalled_since = None

    def silent_for(self) -> float:
        return time.monotonic() - self.last_heard

    def check(self, num_in_flight: int) -> bool:
        """Called while nothing arrives; True when the engine must be restarted now."""
        if num_in_flight == 0:
            self.heard()
            return False
        silent = self.silent_for()
        if silent < self.stall_after:
            return False
        if self.stalled_since is None:
            self.stalled_since = self.last_heard
            logger.error("the engine process has made no progress for %.0f s with %d request(s) "
                         "in flight; it is restarted if it stays so for %g s", silent,
                         num_in_flight, self.restart_after)
        return silent >= self.restart_after

    def reason(self) -> str | None:
        """Why requests get 503 now (None: not stalled)."""
        if self.stalled_since is None:
            return None
        return (f"the engine process has made no progress for {self.silent_for():.0f} s; it is "
                f"restarted after {self.restart_after:g} s")
