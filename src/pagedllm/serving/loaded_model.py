"""What a model store's pool (model_pool.py) holds and says: a loaded model's record (its
engine, its size, its leases, when its keep-alive runs out), the pool's loads and unloads as
/metrics and the page count them, and why a model cannot be had now."""
from __future__ import annotations

import collections
import threading
from dataclasses import dataclass, field

from pagedllm.core.residency import FOREVER
from pagedllm.serving.model_store import StoreEntry


class ModelsBusy(RuntimeError):
    """No room for the model now: every model that could make room is busy."""


class ModelTooLarge(RuntimeError):
    """The model does not fit within --max-memory even with nothing else loaded."""


class ModelLoadFailed(RuntimeError):
    """Loading the model failed (its file, its options); the message says why."""


@dataclass
class LoadedModel:
    entry: StoreEntry
    client: object  # LocalEngineClient
    thread: threading.Thread
    size_bytes: int
    loaded_at: float  # wall clock
    last_used: float  # monotonic
    keep_alive: float
    leases: int = 0

    @property
    def threads(self) -> int:
        """Its engine's compute threads (ModelPool._threads_for_next)."""
        return getattr(self.client, "num_threads", 1)

    @property
    def name(self) -> str:
        return self.entry.name

    @property
    def kind(self) -> str:
        return self.entry.kind

    @property
    def busy(self) -> bool:
        return self.leases > 0 or self.client.num_in_flight > 0

    def expires_in(self, now: float) -> float:
        """Seconds until its keep-alive runs out (FOREVER: never; while busy it restarts)."""
        if self.keep_alive == FOREVER:
            return FOREVER
        return self.keep_alive if self.busy else max(0.0, self.last_used + self.keep_alive - now)


@dataclass
class PoolEvents:
    """Loads and unloads, for /metrics and the page (read by any thread, counts only grow)."""

    loads: collections.Counter = field(default_factory=collections.Counter)
    unloads: collections.Counter = field(default_factory=collections.Counter)  # (name, reason)
    load_seconds: dict = field(default_factory=dict)  # name -> the last load's seconds
    refusals: int = 0  # requests answered 503 because every candidate was busy
