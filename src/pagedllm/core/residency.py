"""Which models stay resident in a model store (pure Python, tested without a model).

A store (serving/model_pool.py) loads a model on its first request. Before it does, it asks
`make_room` which idle models to unload so the new one fits within --max-loaded-models and
--max-memory: the least recently used idle ones first, never one with requests running or
about to run (a busy model is waited for by nobody: the new request is refused with 503 and
Retry-After instead, as Ollama does). After each answer a model stays loaded for its
keep-alive (Ollama's `keep_alive`: a duration, 0 = unload once idle, negative = forever).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

FOREVER = math.inf
DEFAULT_KEEP_ALIVE = 300.0  # Ollama's 5m
_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|h|m|s)")
_UNIT_SECONDS = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}


class KeepAliveError(ValueError):
    """A keep_alive value that is neither a number of seconds nor a duration ("5m")."""


def parse_keep_alive(value: str | int | float | None, default: float = DEFAULT_KEEP_ALIVE
                     ) -> float:
    """Seconds a model stays loaded after its last answer, as Ollama reads `keep_alive`: a
    number is seconds, a string a Go duration ("5m", "1h30m", "10s") or a number; negative
    means forever; None the default."""
    if value is None:
        return default
    if isinstance(value, bool):
        raise KeepAliveError(f"keep_alive must be a duration (\"5m\") or seconds, got {value!r}")
    if isinstance(value, (int, float)):
        seconds = float(value)
    else:
        text = value.strip()
        try:
            seconds = float(text)
        except ValueError:
            seconds = _duration_seconds(text)
    if math.isnan(seconds):
        raise KeepAliveError("keep_alive must be a duration or seconds, got NaN")
    return FOREVER if seconds < 0 else seconds


def _duration_seconds(text: str) -> float:
    sign = -1.0 if text.startswith("-") else 1.0
    body = text.lstrip("+-")
    parts = _DURATION_PART.findall(body)
    if not body or "".join(n + u for n, u in parts) != body:
        raise KeepAliveError(f"keep_alive must be a duration such as \"5m\", \"1h\", \"30s\" "
                             f"or \"-1\" (forever), or a number of seconds; got {text!r}")
    return sign * sum(float(n) * _UNIT_SECONDS[u] for n, u in parts)


@dataclass(frozen=True)
class Resident:
    """A loaded model as the budget sees it."""

    name: str
    size_bytes: int
    busy: bool  # requests running or a handler holding it
    last_used: float


class NeverFits(ValueError):
    """The model alone is larger than --max-memory: unloading everything would not help."""


def make_room(resident: list[Resident], need_bytes: int, max_models: int | None,
              max_bytes: int | None) -> list[str] | None:
    """The names to unload (least recently used idle models first) so that one more model
    of `need_bytes` fits; None when only busy models could make room (try again later).
    Raises NeverFits when it exceeds max_bytes on its own."""
    if max_bytes is not None and need_bytes > max_bytes:
        raise NeverFits(f"needs {need_bytes} bytes, more than the {max_bytes} allowed")
    count = len(resident)
    used = sum(r.size_bytes for r in resident)
    unload: list[str] = []
    for candidate in sorted((r for r in resident if not r.busy), key=lambda r: r.last_used):
        if _fits(count, used, need_bytes, max_models, max_bytes):
            break
        unload.append(candidate.name)
        count -= 1
        used -= candidate.size_bytes
    return unload if _fits(count, used, need_bytes, max_models, max_bytes) else None


def _fits(count: int, used: int, need: int, max_models: int | None, max_bytes: int | None) -> bool:
    return ((max_models is None or count + 1 <= max_models)
            and (max_bytes is None or used + need <= max_bytes))


def expired(last_used: float, keep_alive: float, now: float) -> bool:
    """Whether an idle model's keep-alive has run out."""
    return keep_alive != FOREVER and now >= last_used + keep_alive
