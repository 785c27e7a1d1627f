"""A picture of the engine at one moment, as plain data for the server's live view: every
KV block's state and owners, the running and waiting requests, the fair-share state.

Built by the engine thread between steps (engine.snapshot()), so it never sees a half-made
step; other threads only read the finished record. No torch.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from pagedllm.core.scheduler import Scheduler

# One character a block, so a pool of 10,000 blocks is a 10 kB string, not a list of objects.
FREE, CACHED, USED, SHARED = "0", "1", "2", "3"  # cached: free but holding a reusable prefix


@dataclass(frozen=True)
class RequestView:
    request_id: str
    user: str
    status: str  # "running", "waiting", "preempted"
    num_prompt_tokens: int
    num_output_tokens: int
    num_computed_tokens: int
    num_cached_tokens: int  # prompt tokens served from the prefix cache (-1: not scheduled yet)
    waiting_s: float  # arrival to first scheduling, or until now while it waits
    num_blocks: int


@dataclass(frozen=True)
class EngineSnapshot:
    time: float  # wall clock, seconds
    block_size: int
    blocks: str  # one of FREE/CACHED/USED/SHARED per block id
    block_refs: dict[int, list[str]] = field(default_factory=dict)  # used block -> request ids
    block_hashed: str = ""  # "1" where a block holds a content hash (a full, reusable block)
    requests: list[RequestView] = field(default_factory=list)
    fair_share: dict[str, dict] = field(default_factory=dict)  # user -> weight, virtual time, counts

    def to_json(self) -> dict:
        return {"time": self.time, "block_size": self.block_size, "blocks": self.blocks,
                "block_hashed": self.block_hashed,
                "block_refs": {str(k): v for k, v in self.block_refs.items()},
                "requests": [vars(r) for r in self.requests], "fair_share": self.fair_share}


def take_snapshot(scheduler: Scheduler) -> EngineSnapshot:
    """Read the scheduler and its KV manager (call on the engine thread, between steps)."""
    kv = scheduler.kv
    pool = kv.pool
    refs: dict[int, list[str]] = {}
    for request_id, blocks in kv.req_blocks.items():
        for block in blocks:
            refs.setdefault(block.block_id, []).append(request_id)
    states, hashed = [], []
    for block in pool.blocks:
        if block.ref_cnt > 1:
            states.append(SHARED)
        elif block.ref_cnt == 1:
            states.append(USED)
        else:
            states.append(CACHED if block.block_hash is not None else FREE)
        hashed.append("1" if block.block_hash is not None else "0")
    now = time.monotonic()
    views = []
    for request in list(scheduler.running) + scheduler.waiting.ordered():
        started = request.first_scheduled_time
        views.append(RequestView(
            request.request_id, request.user or "", request.status.value,
            request.num_prompt_tokens, request.num_output_tokens, request.num_computed_tokens,
            request.num_cached_tokens, (started if started is not None else now) - request.arrival_time,
            len(kv.req_blocks.get(request.request_id, ()))))
    return EngineSnapshot(time.time(), kv.block_size, "".join(states), refs, "".join(hashed),
                          views, fair_share(scheduler))


def fair_share(scheduler: Scheduler) -> dict[str, dict]:
    """Per active user: weight, virtual time (tokens served / weight: the fair order admits
    the lowest first), running and waiting counts, the running cap."""
    queue = scheduler.waiting
    users: dict[str, dict] = {}

    def entry(user: str) -> dict:
        return users.setdefault(user, {
            "weight": queue.weight(user), "virtual_time": round(queue.virtual_time.get(user, 0.0), 1),
            "running": 0, "waiting": 0, "max_running": scheduler.max_running_per_user.get(user)})

    for request in scheduler.running:
        entry(queue.user_of(request))["running"] += 1
    for user, count in queue.waiting_by_user().items():
        entry(user)["waiting"] += count
    return users


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    kv_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    num_prompt_tokens: int
    num_generation_tokens: int
    last_step_tokens: int
    memory_pressure: bool = False  # new requests wait (engine/memory_guard.py)
    # Speculative decoding (core/speculation.py): verifications with proposals, proposals,
    # accepted proposals, and accepted ones by position in their proposal (vLLM's counters).
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_position: tuple[int, ...] = ()
    # LoRA adapters (lora/): running requests and requests admitted since start, by adapter
    # name; adapters copied into a slot (each a copy of its weights).
    lora_running: dict[str, int] = field(default_factory=dict)
    lora_requests: dict[str, int] = field(default_factory=dict)
    lora_slot_loads: int = 0


def sum_stats(rows: list[EngineStats]) -> EngineStats:
    """Several engines' figures as one (replicas, a model store)."""
    total = sum(r.kv_blocks_total for r in rows)
    used = sum(r.kv_blocks_used for r in rows)
    summed = {name: sum(getattr(r, name) for r in rows) for name in (
        "num_running", "num_waiting", "prefix_cache_queries", "prefix_cache_hits",
        "num_preemptions", "num_prompt_tokens", "num_generation_tokens", "last_step_tokens",
        "spec_num_drafts", "spec_num_draft_tokens", "spec_num_accepted_tokens")}
    positions = max((len(r.spec_accepted_per_position) for r in rows), default=0)
    per_position = tuple(sum(r.spec_accepted_per_position[i] for r in rows
                             if i < len(r.spec_accepted_per_position)) for i in range(positions))
    by_adapter = {name: _sum_dicts([getattr(r, name) for r in rows])
                  for name in ("lora_running", "lora_requests")}
    return EngineStats(kv_blocks_used=used, kv_blocks_total=total,
                       lora_slot_loads=sum(r.lora_slot_loads for r in rows), **by_adapter,
                       spec_accepted_per_position=per_position,
                       kv_usage=used / total if total else 0.0,
                       memory_pressure=any(r.memory_pressure for r in rows), **summed)


def _sum_dicts(dicts: list[dict[str, int]]) -> dict[str, int]:
    total: dict[str, int] = {}
    for counts in dicts:
        for key, n in counts.items():
            total[key] = total.get(key, 0) + n
    return total
