"""The engine snapshot behind the live server view: block states and owners, requests and
fair share, read from a scheduler driven by a fake runner (no torch, no model)."""
from test_scheduler import fake_step, make, req

from pagedllm.core.snapshot import CACHED, FREE, SHARED, USED, take_snapshot


def test_blocks_are_free_used_shared_or_cached():
    sched = make(num_blocks=16, block_size=4)
    snap = take_snapshot(sched)
    assert snap.blocks == FREE * 16 and snap.requests == [] and snap.block_refs == {}
    # Two requests with the same 8-token prefix: the second reuses the first's two full blocks.
    sched.add_request(req("a", 10, max_tokens=8))
    fake_step(sched)
    sched.add_request(req("b", 10, max_tokens=8))
    fake_step(sched)
    snap = take_snapshot(sched)
    shared = [i for i, s in enumerate(snap.blocks) if s == SHARED]
    assert len(shared) == 2
    for block_id in shared:
        assert sorted(snap.block_refs[block_id]) == ["a", "b"]
        assert snap.block_hashed[block_id] == "1"
    used = [i for i, s in enumerate(snap.blocks) if s == USED]
    assert used and all(len(snap.block_refs[i]) == 1 for i in used)
    assert {r.request_id: r.status for r in snap.requests} == {"a": "running", "b": "running"}
    by_id = {r.request_id: r for r in snap.requests}
    assert by_id["b"].num_cached_tokens == 8 and by_id["a"].num_blocks == 3
    # Finished: the full blocks stay cached (free, hash kept), the rest free.
    for rid in ("a", "b"):
        sched.finish_request(rid, None)
    snap = take_snapshot(sched)
    assert set(snap.blocks) <= {FREE, CACHED} and snap.blocks.count(CACHED) >= 2
    assert snap.block_refs == {} and snap.requests == []


def test_waiting_requests_and_fair_share():
    sched = make(num_blocks=64, block_size=4, max_seqs=1)
    sched.waiting.weights = {"alice": 2.0}
    for i, user in enumerate(["alice", "bob", "bob"]):
        r = req(f"r{i}", 6)
        r.user = user
        sched.add_request(r)
    fake_step(sched)
    snap = take_snapshot(sched)
    assert [r.status for r in snap.requests] == ["running", "waiting", "waiting"]
    assert snap.requests[1].waiting_s >= 0 and snap.requests[1].num_blocks == 0
    assert snap.fair_share["alice"]["running"] == 1 and snap.fair_share["alice"]["weight"] == 2.0
    assert snap.fair_share["bob"] == {"weight": 1.0, "virtual_time": 0.0, "running": 0,
                                      "waiting": 2, "max_running": None}
    data = snap.to_json()
    assert data["blocks"] == snap.blocks and isinstance(data["requests"][0], dict)
