"""Tokens per minute per key, with a fake clock: reservations at admission, settling to what
was used, the sliding window, and the 429's Retry-After (no server, no model)."""
import pytest

from pagedllm.server.errors import APIError
from pagedllm.server.limits import TokenRateLimiter


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def test_running_requests_reserve_their_max_tokens():
    clock = Clock()
    limiter = TokenRateLimiter(clock)
    first = limiter.reserve("k", 200, 10, 150)
    assert limiter.used("k") == 160
    with pytest.raises(APIError) as refused:  # 160 + 160 > 200, though nothing is used yet
        limiter.reserve("k", 200, 10, 150)
    assert refused.value.status == 429 and refused.value.code == "rate_limit_exceeded"
    assert int(refused.value.headers["Retry-After"]) == 60
    limiter.settle(first, 30)  # it stopped early: the rest is free again
    assert limiter.used("k") == 30
    limiter.reserve("k", 200, 10, 150)
    assert limiter.used("k") == 190


def test_a_request_without_max_tokens_gets_what_is_left():
    from pagedllm.core.output_budget import OutputCaps, resolve_max_tokens

    limiter = TokenRateLimiter(Clock())
    limiter.reserve("k", 100, 20, 50)
    granted = resolve_max_tokens(None, 10, OutputCaps(8000, key_budget=100 - limiter.used("k")))
    assert granted == 20  # 100 - 70 used - its own 10 prompt tokens
    limiter.reserve("k", 100, 10, granted)
    granted = resolve_max_tokens(None, 1, OutputCaps(8000, key_budget=100 - limiter.used("k")))
    with pytest.raises(APIError):  # nothing left, not even one token
        limiter.reserve("k", 100, 1, granted)


def test_the_window_slides_and_retry_after_says_when():
    clock = Clock()
    limiter = TokenRateLimiter(clock)
    limiter.reserve("k", 100, 0, 60)
    clock.now += 20
    limiter.reserve("k", 100, 0, 40)
    clock.now += 10
    with pytest.raises(APIError) as refused:
        limiter.reserve("k", 100, 0, 50)
    # The first 60 leave the window 60 s after they came: 30 s from now.
    assert refused.value.headers["Retry-After"] == "30"
    clock.now += 30
    limiter.reserve("k", 100, 0, 50)
    assert limiter.used("k") == 90
    limiter.check("other", 100)  # keys are separate
    limiter.reserve("k", None, 5, 10_000)  # no limit: always granted


def test_check_refuses_a_key_at_its_limit():
    limiter = TokenRateLimiter(Clock())
    limiter.reserve("k", 10, 5, 5)
    with pytest.raises(APIError):
        limiter.check("k", 10)
    limiter.check("k", None)
