"""Admission limits checked before a request reaches the engine: the bounded queue and
per-key tokens-per-minute. Both answer 429 with Retry-After."""
from __future__ import annotations

import math
import threading
import time
from collections import deque

from pagedllm.server.errors import APIError

WINDOW_SECONDS = 60.0


class TokenRateLimiter:
    """Tokens (prompt + completion) used per key over a sliding minute."""

    def __init__(self, clock=time.monotonic):
        self._used: dict[str, deque[tuple[float, int]]] = {}
        self._lock = threading.Lock()
        self._clock = clock

    def _trim(self, name: str, now: float) -> deque:
        window = self._used.setdefault(name, deque())
        while window and window[0][0] <= now - WINDOW_SECONDS:
            window.popleft()
        return window

    def used(self, name: str) -> int:
        with self._lock:
            return sum(n for _, n in self._trim(name, self._clock()))

    def record(self, name: str, num_tokens: int) -> None:
        with self._lock:
            self._trim(name, self._clock()).append((self._clock(), num_tokens))

    def check(self, name: str, limit: int | None) -> None:
        if limit is None:
            return
        with self._lock:
            now = self._clock()
            window = self._trim(name, now)
            used = sum(n for _, n in window)
            if used < limit:
                return
            # Wait until enough old usage leaves the window to get under the limit.
            excess, retry_at = used - limit, now + WINDOW_SECONDS
            for stamp, n in window:
                excess -= n
                if excess < 0:
                    retry_at = stamp + WINDOW_SECONDS
                    break
        retry_after = max(1, math.ceil(retry_at - now))
        raise APIError(429, f"rate limit: {used} of {limit} tokens per minute used; retry in "
                            f"{retry_after}s", None, "rate_limit_exceeded",
                       {"Retry-After": str(retry_after)})


def check_queue(num_waiting: int, num_new: int, max_queue: int | None) -> None:
    if max_queue is None or num_waiting + num_new <= max_queue:
        return
    raise APIError(429, f"the queue is full ({num_waiting} of {max_queue} waiting); retry shortly",
                   None, "queue_full", {"Retry-After": "1"})
