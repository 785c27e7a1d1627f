"""Prefix-cache-aware routing, on Ray Serve's request-router API.

A request goes to the replica that already holds the longest run of its leading KV blocks
(the engine's own hash chain, with the same per-user salt), unless that replica's queue is
longer than the shortest one by more than `imbalance_threshold`; otherwise (and when no
replica holds any of its blocks) to the less loaded of two random replicas, as Ray Serve's
default router does. So a conversation's next turn finds its prefix where it was computed.

What a replica holds is what this router sent it, remembered per replica up to the size of
its KV pool (oldest forgotten first): a block the replica has since evicted costs one miss,
and a replica that dies is forgotten at once.
"""
from __future__ import annotations

import collections
import random

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from pagedllm.core.kv_cache import prefix_block_hashes
from pagedllm.core.request import Request


class PrefixAffinityRouter(RequestRouter):
    def initialize_state(self, block_size: int = 16, imbalance_threshold: int = 2,
                         max_blocks_per_replica: int = 65536, **_ignored):
        self._block_size = block_size
        self._imbalance_threshold = imbalance_threshold
        self._max_blocks = max_blocks_per_replica
        # replica -> block hashes it was sent, oldest first (an LRU by routing time)
        self._held: dict[ReplicaID, collections.OrderedDict] = {}

    def _hashes(self, pending_request: PendingRequest | None) -> list[bytes]:
        request = _engine_request(pending_request)
        if request is None:
            return []
        return prefix_block_hashes(request.prompt_token_ids, self._block_size, request.cache_salt)

    def _leading_run(self, replica: RunningReplica, hashes: list[bytes]) -> int:
        held = self._held.get(replica.replica_id)
        if not held:
            return 0
        run = 0
        for block_hash in hashes:
            if block_hash not in held:
                break
            run += 1
        return run

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None
                              ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        two_random = random.sample(candidate_replicas, min(2, len(candidate_replicas)))
        hashes = self._hashes(pending_request)
        runs = {r.replica_id: self._leading_run(r, hashes) for r in candidate_replicas}
        best_run = max(runs.values())
        if best_run == 0:
            return [two_random]
        queue = self._queue_lengths(candidate_replicas)
        # Among the replicas holding the longest run (a shared system prompt may be on
        # several), the least loaded.
        best = min((r for r in candidate_replicas if runs[r.replica_id] == best_run),
                   key=lambda r: queue[r.replica_id])
        if queue[best.replica_id] - min(queue.values()) > self._imbalance_threshold:
            return [two_random]
        # If the best one turns out full, Ray Serve tries the next rank.
        return [[best], [r for r in two_random if r is not best] or two_random]

    def _queue_lengths(self, replicas: list[RunningReplica]) -> dict[ReplicaID, int]:
        """Requests in flight per replica, as Ray Serve's cache last heard (0 if unknown)."""
        return {r.replica_id: self._replica_queue_len_cache.get(r.replica_id) or 0
                for r in replicas}

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result) -> None:
        hashes = self._hashes(pending_request)
        if not hashes:
            return
        held = self._held.setdefault(replica_id, collections.OrderedDict())
        for block_hash in hashes:
            held[block_hash] = None
            held.move_to_end(block_hash)
        while len(held) > self._max_blocks:
            held.popitem(last=False)

    def on_replica_actor_died(self, replica_id: ReplicaID):
        super().on_replica_actor_died(replica_id)
        self._held.pop(replica_id, None)

    def update_replicas(self, replicas: list[RunningReplica]):
        super().update_replicas(replicas)
        alive = {r.replica_id for r in replicas}
        for replica_id in list(self._held):
            if replica_id not in alive:
                del self._held[replica_id]


def _engine_request(pending_request: PendingRequest | None) -> Request | None:
    """The engine Request of a generate() call (other calls, such as describe(), have none)."""
    if pending_request is None:
        return None
    for arg in pending_request.args:
        if isinstance(arg, Request):
            return arg
    return None
