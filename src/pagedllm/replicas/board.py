"""The replicas' notice board: each engine replica posts its figures (stats, waiting users,
pid) twice a second and reads the fair-share weights from here; the ingress reads every
replica's figures for /metrics and admission. It holds no request and no KV state, so
losing it loses nothing but a few figures (the launcher owns it; replicas re-post)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import ray

BOARD_NAME = "pagedllm-board"
STALE_AFTER_S = 5.0  # a replica silent this long is left out of the figures (dead or stuck)


@dataclass
class ReplicaFigures:
    replica_id: str
    pid: int
    stats: object  # EngineStats
    waiting_by_user: dict
    cache: object  # CacheConfig
    cpu: object  # kernels.Capabilities
    posted_at: float = field(default_factory=time.time)
    node: str = ""  # the Ray node it runs on, and that node's host name
    host: str = ""
    snapshot: object = None  # EngineSnapshot: the page's live view of this replica


@ray.remote(num_cpus=0)
class ReplicaBoard:
    def __init__(self):
        self._figures: dict[str, ReplicaFigures] = {}
        self._weights: dict[str, float] = {}
        self._weights_version = 0

    def post(self, figures: ReplicaFigures) -> tuple[int, dict[str, float]]:
        """Record a replica's figures; answer the current fair-share weights (and version)."""
        figures.posted_at = time.time()
        self._figures[figures.replica_id] = figures
        return self._weights_version, self._weights

    def live(self) -> list[ReplicaFigures]:
        """The figures of every replica heard from within STALE_AFTER_S, by replica id."""
        horizon = time.time() - STALE_AFTER_S
        return sorted((f for f in self._figures.values() if f.posted_at >= horizon),
                      key=lambda f: f.replica_id)

    def set_weights(self, weights: dict[str, float]) -> int:
        self._weights = dict(weights)
        self._weights_version += 1
        return self._weights_version
