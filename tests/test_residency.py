"""Which models stay resident in a store (core/residency.py, pure Python): Ollama's
keep_alive values, and which idle models make room for a new one (least recently used
first, never a busy one)."""
from __future__ import annotations

import math

import pytest

from pagedllm.core.residency import (DEFAULT_KEEP_ALIVE, FOREVER, KeepAliveError, NeverFits,
                                     Resident, expired, make_room, parse_keep_alive)


@pytest.mark.parametrize("value, seconds", [
    (None, DEFAULT_KEEP_ALIVE), ("5m", 300.0), ("1h30m", 5400.0), ("10s", 10.0),
    ("1.5h", 5400.0), ("250ms", 0.25), (0, 0.0), ("0", 0.0), (30, 30.0), (2.5, 2.5),
    ("-1", FOREVER), (-1, FOREVER), ("-5m", FOREVER), ("  45 ", 45.0)])
def test_keep_alive_reads_as_ollama_does(value, seconds):
    assert parse_keep_alive(value) == seconds


@pytest.mark.parametrize("value", ["", "5 minutes", "m", "5x", "1h-2m", True, "nan", float("nan")])
def test_bad_keep_alive_is_refused_with_the_forms_it_takes(value):
    with pytest.raises(KeepAliveError, match="keep_alive"):
        parse_keep_alive(value)


def test_expiry():
    assert not expired(100.0, 300.0, 399.0) and expired(100.0, 300.0, 400.0)
    assert expired(100.0, 0.0, 100.0)
    assert not expired(0.0, FOREVER, math.inf / 2)


def r(name, size=10, busy=False, used=0.0):
    return Resident(name, size, busy, used)


def test_room_is_free_when_under_both_bounds():
    assert make_room([r("a")], 10, max_models=3, max_bytes=100) == []
    assert make_room([], 10, max_models=None, max_bytes=None) == []


def test_the_least_recently_used_idle_model_goes_first():
    resident = [r("new", used=3.0), r("old", used=1.0), r("mid", used=2.0)]
    assert make_room(resident, 10, max_models=3, max_bytes=None) == ["old"]
    assert make_room(resident, 10, max_models=2, max_bytes=None) == ["old", "mid"]


def test_memory_bound_unloads_until_it_fits():
    resident = [r("a", 40, used=1.0), r("b", 40, used=2.0)]
    assert make_room(resident, 30, max_models=None, max_bytes=100) == ["a"]
    assert make_room(resident, 20, max_models=None, max_bytes=100) == []
    assert make_room(resident, 90, max_models=None, max_bytes=100) == ["a", "b"]


def test_a_busy_model_is_never_unloaded():
    resident = [r("busy", 60, busy=True, used=0.0), r("idle", 30, used=5.0)]
    assert make_room(resident, 30, max_models=None, max_bytes=100) == ["idle"]
    # Only the busy one could make room: nothing is unloaded, the caller is told to wait.
    assert make_room(resident, 50, max_models=None, max_bytes=100) is None
    assert make_room([r("busy", busy=True)], 10, max_models=1, max_bytes=None) is None


def test_a_model_larger_than_the_budget_never_fits():
    with pytest.raises(NeverFits):
        make_room([], 101, max_models=None, max_bytes=100)
