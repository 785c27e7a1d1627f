"""Weighted fair admission between users, per-user caps, fair preemption (no model)."""
from pagedllm.core.fair_queue import FairQueue
from pagedllm.core.request import FinishReason, Request, SamplingParams
from test_scheduler import fake_step, make


def user_req(rid, user, n_prompt=20, max_tokens=8, start=1):
    return Request(rid, list(range(start, start + n_prompt)), SamplingParams(max_tokens=max_tokens),
                   max_model_len=10_000, user=user)


def finish_order(sched, max_steps=10_000):
    order = []
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            return order
        before = set(sched.requests)
        fake_step(sched)
        order += sorted(before - set(sched.requests), key=lambda r: int(r[1:]))
    raise AssertionError("did not finish")


def test_flooding_user_cannot_starve_another():
    sched = make(num_blocks=400, budget=64, max_seqs=4)
    for i in range(40):
        sched.add_request(user_req(f"a{i}", "alice", start=1000 + i * 50))
    fake_step(sched)
    fake_step(sched)
    sched.add_request(user_req("b0", "bob", start=5))
    sched.add_request(user_req("b1", "bob", start=7))
    order = finish_order(sched)
    tenth_a = [r for r in order if r.startswith("a")][9]
    assert order.index("b0") < order.index(tenth_a)
    assert order.index("b1") < order.index(tenth_a)


def test_plain_fcfs_without_users():
    sched = make(num_blocks=400, budget=64, max_seqs=2)
    for i in range(6):
        sched.add_request(user_req(f"r{i}", None, start=100 * i + 1))
    assert finish_order(sched) == [f"r{i}" for i in range(6)]


def test_weights_share_tokens_in_proportion():
    sched = make(num_blocks=2000, budget=16, max_seqs=2)
    sched.waiting.weights = {"heavy": 3.0, "light": 1.0}
    for i in range(30):
        sched.add_request(user_req(f"h{i}", "heavy", n_prompt=8, max_tokens=4, start=1 + 40 * i))
        sched.add_request(user_req(f"l{i}", "light", n_prompt=8, max_tokens=4, start=5000 + 40 * i))
    served = {"heavy": 0, "light": 0}
    for _ in range(60):
        out = fake_step(sched)
        for item in out.scheduled:
            served[item.user] += item.num_new_tokens
    ratio = served["heavy"] / served["light"]
    assert 2.0 < ratio < 4.5, served


def test_max_concurrent_per_user():
    sched = make(num_blocks=400, budget=256, max_seqs=8)
    sched.max_running_per_user = {"alice": 2}
    for i in range(5):
        sched.add_request(user_req(f"a{i}", "alice", start=100 * i + 1))
    sched.add_request(user_req("b0", "bob", start=900))
    fake_step(sched)
    running = [r.request_id for r in sched.running]
    assert sorted(running) == ["a0", "a1", "b0"]
    finish_order(sched)


def test_new_user_does_not_bank_idle_time():
    queue = FairQueue()
    queue.num_running["alice"] = 1
    queue.virtual_time["alice"] = 5000.0
    queue.append(user_req("b0", "bob"))
    assert queue.virtual_time["bob"] == 5000.0


def test_preemption_takes_from_the_user_above_fair_share():
    sched = make(num_blocks=14, block_size=4, budget=64, max_seqs=4)
    sched.add_request(user_req("a0", "alice", n_prompt=20, max_tokens=30, start=1))
    fake_step(sched)  # alice gets ahead in virtual time
    sched.add_request(user_req("b0", "bob", n_prompt=8, max_tokens=30, start=500))
    sched.add_request(user_req("a1", "alice", n_prompt=8, max_tokens=30, start=900))
    preempted = []
    for _ in range(40):
        out = fake_step(sched)
        preempted += [sched.requests[rid].user for rid in out.preempted]
        if preempted:
            break
    assert preempted and preempted[0] == "alice"


def test_ordered_view_interleaves_users():
    queue = FairQueue()
    for i in range(3):
        queue.append(user_req(f"a{i}", "alice", n_prompt=10))
    queue.append(user_req("b0", "bob", n_prompt=10))
    assert [r.request_id for r in queue.ordered()] == ["a0", "b0", "a1", "a2"]
    assert queue.waiting_by_user() == {"alice": 3, "bob": 1}


def test_abort_from_fair_queue():
    sched = make()
    sched.add_request(user_req("a0", "alice"))
    sched.finish_request("a0", FinishReason.ABORT)
    assert len(sched.waiting) == 0


def test_per_user_state_is_bounded_whatever_the_number_of_users():
    """A flood of distinct `user` values (each one request) leaves at most MAX_IDLE_USERS
    idle users' entries, and only those still in debt; a finished user with nothing owed
    leaves nothing behind."""
    from pagedllm.core import fair_queue

    sched = make(num_blocks=400, budget=64, max_seqs=4)
    for i in range(fair_queue.MAX_IDLE_USERS + 300):
        sched.add_request(user_req(f"u{i}", f"user-{i}", n_prompt=4, max_tokens=1, start=10 + i))
    finish_order(sched)
    queue = sched.waiting
    assert queue.tracked_users() <= fair_queue.MAX_IDLE_USERS
    assert not queue.num_running and not queue.waiting_by_user()
    lone = make(num_blocks=400, budget=64, max_seqs=4)
    lone.add_request(user_req("x0", "only", n_prompt=4, max_tokens=1))
    finish_order(lone)
    assert lone.waiting.tracked_users() == 0  # nobody else active: nothing owed to anyone
