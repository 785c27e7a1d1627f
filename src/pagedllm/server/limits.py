"""Admission limits checked before a request reaches the engine: the bounded queue and
per-key tokens-per-minute. Both answer 429 with Retry-After."""
from __future__ import annotations

import math
import threading
import time
from collections import deque
from dataclasses import dataclass

from pagedllm.server.errors import APIError

WINDOW_SECONDS = 60.0


@dataclass
class TokenUse:
    """Tokens one request took (or may still take) at `stamp`: its prompt plus its whole
    max_tokens while it runs, what it really used once settled."""
    stamp: float
    tokens: int


class TokenRateLimiter:
    """Tokens (prompt + completion) per key over a sliding minute, enforced while answers are
    generated: a request reserves its prompt and its max_tokens when admitted, so requests
    running at once can never together pass the limit; the reservation shrinks to what was
    really used when it ends. A request without max_tokens gets what the key has left
    (OutputCaps.key_budget)."""

    def __init__(self, clock=time.monotonic):
        self._used: dict[str, deque[TokenUse]] = {}
        self._lock = threading.Lock()
        self._clock = clock

    def _trim(self, name: str, now: float) -> deque[TokenUse]:
        window = self._used.setdefault(name, deque())
        while window and window[0].stamp <= now - WINDOW_SECONDS:
            window.popleft()
        return window

    def used(self, name: str) -> int:
        with self._lock:
            return sum(use.tokens for use in self._trim(name, self._clock()))

    def check(self, name: str, limit: int | None, num_tokens: int = 1) -> None:
        """429 unless `num_tokens` more fit under the limit now."""
        if limit is None:
            return
        with self._lock:
            now = self._clock()
            used = sum(use.tokens for use in self._trim(name, now))
            if used + num_tokens <= limit:
                return
            refusal = self._refusal(name, limit, used, num_tokens, now)
        raise refusal

    def _refusal(self, name: str, limit: int, used: int, needed: int, now: float) -> APIError:
        """The 429, with the seconds until enough old usage leaves the window (lock held)."""
        excess, retry_at = used + needed - limit, now + WINDOW_SECONDS
        for use in self._used[name]:
            excess -= use.tokens
            if excess <= 0:
                retry_at = use.stamp + WINDOW_SECONDS
                break
        retry_after = max(1, math.ceil(retry_at - now))
        return APIError(429, f"rate limit: {used} of {limit} tokens per minute used or reserved "
                             f"by running requests; this request needs {needed}; retry in "
                             f"{retry_after}s", None, "rate_limit_exceeded",
                        {"Retry-After": str(retry_after)})

    def reserve(self, name: str, limit: int | None, num_prompt_tokens: int,
                max_tokens: int) -> TokenUse:
        """Reserve a request's prompt and its whole max_tokens (decided by resolve_max_tokens,
        which held an open-ended request to what the key had left): 429 if they do not fit."""
        with self._lock:
            now = self._clock()
            window = self._trim(name, now)
            used = sum(use.tokens for use in window)
            if limit is not None and used + num_prompt_tokens + max_tokens > limit:
                raise self._refusal(name, limit, used, num_prompt_tokens + max_tokens, now)
            use = TokenUse(now, num_prompt_tokens + max_tokens)
            window.append(use)
            return use

    def settle(self, use: TokenUse, num_tokens: int) -> None:
        """The request ended having used `num_tokens`: its reservation becomes that."""
        with self._lock:
            use.tokens = num_tokens


def check_queue(num_waiting: int, num_new: int, max_queue: int | None) -> None:
    if max_queue is None or num_waiting + num_new <= max_queue:
        return
    raise APIError(429, f"the queue is full ({num_waiting} of {max_queue} waiting); retry shortly",
                   None, "queue_full", {"Retry-After": "1"})
