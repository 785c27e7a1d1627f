"""The prefix-cache-aware router's choices, without a cluster: which replica holds the
longest run of a request's leading blocks, when load overrides it, and what it forgets."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

pytest.importorskip("ray.serve", reason="Ray Serve is the optional extra pagedllm[ray]")

from pagedllm.core.kv_cache import prefix_block_hashes  # noqa: E402
from pagedllm.core.request import Request, SamplingParams  # noqa: E402
from pagedllm.replicas.router import PrefixAffinityRouter  # noqa: E402

BLOCK = 4


def make_router(queue_lengths: dict, threshold: int = 2, max_blocks: int = 1000):
    router = object.__new__(PrefixAffinityRouter)  # Ray Serve's own set-up is not needed here
    router.initialize_state(block_size=BLOCK, imbalance_threshold=threshold,
                            max_blocks_per_replica=max_blocks)
    router._replica_queue_len_cache = SimpleNamespace(get=queue_lengths.get)
    return router


def pending(tokens, salt=None):
    request = Request("r", tokens, SamplingParams(), max_model_len=1000, cache_salt=salt)
    return SimpleNamespace(args=[request, False])


def choose(router, replicas, request):
    return asyncio.run(router.choose_replicas(replicas, request))


A, B, C = (SimpleNamespace(replica_id=name) for name in "abc")


def test_the_replica_with_the_longest_leading_run_comes_first():
    router = make_router({"a": 0, "b": 0, "c": 0})
    conversation = list(range(20))
    router.on_request_routed(pending(conversation[:8]), "a", None)   # 2 blocks on a
    router.on_request_routed(pending(conversation[:16]), "b", None)  # 4 blocks on b
    ranks = choose(router, [A, B, C], pending(conversation))
    assert ranks[0] == [B]
    assert B not in ranks[1] and ranks[1]  # if b is full: two others at random


def test_only_leading_blocks_count():
    router = make_router({"a": 0, "b": 0})
    router.on_request_routed(pending([9, 9, 9, 9] + list(range(12))), "a", None)
    # Same later tokens, different first block: the chain differs, nothing is held.
    ranks = choose(router, [A, B], pending(list(range(16))))
    assert len(ranks) == 1 and sorted(r.replica_id for r in ranks[0]) == ["a", "b"]


def test_the_salt_keeps_users_apart():
    router = make_router({"a": 0, "b": 0})
    router.on_request_routed(pending(list(range(16)), salt="alice"), "a", None)
    assert choose(router, [A, B], pending(list(range(16)), salt="alice"))[0] == [A]
    assert len(choose(router, [A, B], pending(list(range(16)), salt="bob"))) == 1  # random two


def test_a_much_busier_holder_loses_to_load():
    router = make_router({"a": 5, "b": 0}, threshold=2)
    router.on_request_routed(pending(list(range(16))), "a", None)
    ranks = choose(router, [A, B], pending(list(range(16))))
    assert len(ranks) == 1 and sorted(r.replica_id for r in ranks[0]) == ["a", "b"]
    router._replica_queue_len_cache = SimpleNamespace(get={"a": 2, "b": 0}.get)
    assert choose(router, [A, B], pending(list(range(16))))[0] == [A]  # within the threshold


def test_calls_without_a_request_go_to_two_random_replicas():
    router = make_router({})
    ranks = choose(router, [A, B, C], SimpleNamespace(args=[]))
    assert len(ranks) == 1 and len(ranks[0]) == 2
    assert choose(router, [], None) == []


def test_memory_per_replica_is_bounded_oldest_first():
    router = make_router({"a": 0, "b": 0}, max_blocks=4)
    router.on_request_routed(pending(list(range(16))), "a", None)       # 4 blocks
    router.on_request_routed(pending(list(range(100, 108))), "a", None)  # 2 more: 2 oldest go
    held = router._held["a"]
    assert len(held) == 4
    chain = prefix_block_hashes(list(range(16)), BLOCK)
    assert chain[0] not in held and chain[3] in held
    # The first block is forgotten, so the old conversation no longer leads anywhere.
    assert len(choose(router, [A, B], pending(list(range(16))))) == 1


def test_replicas_that_left_are_forgotten(monkeypatch):
    router = make_router({"a": 0, "b": 0})
    router.on_request_routed(pending(list(range(16))), "a", None)
    monkeypatch.setattr("ray.serve.request_router.RequestRouter.update_replicas",
                        lambda self, replicas: None)
    router.update_replicas([B])
    assert "a" not in router._held


def test_ties_go_to_the_less_loaded_holder():
    """A system prompt every conversation shares ends up on both: then load decides."""
    router = make_router({"a": 2, "b": 1})
    router.on_request_routed(pending(list(range(8))), "a", None)
    router.on_request_routed(pending(list(range(8))), "b", None)
    assert choose(router, [A, B], pending(list(range(8)) + [50, 51, 52, 53]))[0] == [B]
