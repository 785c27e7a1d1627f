"""Planning ahead (overlapped steps): the scheduler plans step t+1 before step t's tokens are
known. Checked without a model: a fake device that writes each planned token into its
request's cache and samples from what the cache holds, so a plan that computes a position
twice, skips one or reads a token it does not have is caught, and every request must get
exactly the tokens that planning one step at a time gives it."""
from hypothesis import given, settings, strategies as st

from pagedllm.core.output_processor import token_stop_reason
from pagedllm.core.request import FinishReason, Request, RequestStatus, SamplingParams
from pagedllm.core.scheduler import Scheduler
from pagedllm.core.step_records import PLACEHOLDER, RunnerOutput, SampledToken
from test_scheduler import make as make_scheduler

EOS = 0
MAX_MODEL_LEN = 64


def next_token(tokens: list[int]) -> int:
    """The fake model: the next token from every token before it (EOS now and then)."""
    return (sum(tokens) * 31 + len(tokens) * 7) % 53


class FakeDevice:
    """The KV cache as the token written in each slot (block, offset), read through the
    plan's block table as attention reads it: a slot never written fails the read, and a
    stale or wrong one changes the tokens sampled."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.slots: dict[tuple[int, int], int] = {}

    def run(self, plan, previous: dict[str, int]) -> dict[str, int]:
        bs, sampled = self.block_size, {}
        for item in plan.scheduled:
            for offset, token in enumerate(item.token_ids):
                if token == PLACEHOLDER:  # the token the step before sampled, on the device
                    token = previous[item.request_id]
                position = item.start + offset
                self.slots[item.block_table[position // bs], position % bs] = token
            if item.samples:
                end = item.start + item.num_new_tokens
                sampled[item.request_id] = next_token(
                    [self.slots[item.block_table[p // bs], p % bs] for p in range(end)])
        return sampled


def apply(sched: Scheduler, plan, sampled: dict[str, int], finished: dict[str, list[int]]):
    result = RunnerOutput({rid: [SampledToken(t)] for rid, t in sampled.items()})
    for request, tokens, _ in sched.update_from_output(plan, result):
        for token in tokens:
            sched.append_token(request, token)
            if token_stop_reason(request) is not None:
                sched.finish_request(request.request_id, token_stop_reason(request))
                finished[request.request_id] = request.output_token_ids
                break


def make(num_blocks, budget, max_seqs=8):
    return make_scheduler(num_blocks, 4, budget, max_seqs, max_model_len=MAX_MODEL_LEN)


def run(workload, num_blocks, budget, ahead: bool, max_steps=2000):
    """workload: (arrival step, prompt length, max_tokens) per request. Returns each
    request's tokens, the scheduler and how many steps it took."""
    sched, device, finished = make(num_blocks, budget), FakeDevice(4), {}
    pending = None  # (plan, sampled) of the step still "running"
    step = 0
    while step < max_steps:
        for i, (arrival, n_prompt, max_tokens) in enumerate(workload):
            if arrival == step:
                sched.add_request(Request(f"r{i}", [(i * 7 + j) % 50 + 1 for j in range(n_prompt)],
                                          SamplingParams(max_tokens=max_tokens),
                                          eos_token_ids=(EOS,), max_model_len=MAX_MODEL_LEN))
        step += 1
        if not sched.has_unfinished_requests() and pending is None:
            if step > max(a for a, _, _ in workload):
                break
            continue
        plan = sched.schedule(ahead=ahead) if sched.has_unfinished_requests() else None
        sampled = device.run(plan, pending[1] if pending else {}) if plan else {}
        if ahead:
            check_tables(sched)
            if pending is not None:
                apply(sched, *pending, finished)
            pending = (plan, sampled) if plan is not None and not plan.is_empty else None
        else:
            apply(sched, plan, sampled, finished)
    return finished, sched, step


def check_tables(sched):
    """After planning ahead (the step before not yet applied): each running request's blocks
    cover exactly what it computed, which is every token it knows and all but the last of
    its pending ones (one from the step still running, one from the step just planned)."""
    for request in sched.running:
        assert len(sched.kv.req_blocks[request.request_id]) == \
            sched.kv.blocks_needed(request.num_computed_tokens)
        assert request.num_pending_tokens in (0, 1, 2)
        if request.num_pending_tokens:
            assert request.num_computed_tokens == \
                request.num_tokens + request.num_pending_tokens - 1


workloads = st.lists(st.tuples(st.integers(0, 6), st.integers(1, 20), st.integers(1, 12)),
                     min_size=1, max_size=8)


@settings(max_examples=150, deadline=None)
@given(workloads, st.integers(12, 40), st.integers(4, 24))
def test_planning_ahead_gives_every_request_the_tokens_of_planning_step_by_step(
        workload, num_blocks, budget):
    expected, _, _ = run(workload, num_blocks, budget, ahead=False)
    got, sched, _ = run(workload, num_blocks, budget, ahead=True)
    assert got == expected
    assert len(got) == len(workload)  # nothing lost
    assert not sched.requests and sched.kv.num_free_blocks == sched.kv.num_blocks


def test_a_pending_token_is_planned_as_a_placeholder_and_becomes_known_with_its_results():
    sched = make(num_blocks=32, budget=16)
    sched.add_request(Request("a", [1, 2, 3], SamplingParams(max_tokens=5),
                              eos_token_ids=(EOS,), max_model_len=MAX_MODEL_LEN))
    first = sched.schedule(ahead=True)
    assert first.ahead and first.scheduled[0].token_ids == (1, 2, 3)
    request = sched.requests["a"]
    assert (request.num_computed_tokens, request.num_pending_tokens) == (3, 1)
    second = sched.schedule(ahead=True)  # the first step's token is not known yet
    assert second.scheduled[0].token_ids == (PLACEHOLDER,)
    assert second.scheduled[0].start == 3 and second.scheduled[0].samples
    assert (request.num_computed_tokens, request.num_pending_tokens) == (4, 2)
    sched.update_from_output(first, RunnerOutput({"a": [SampledToken(9)]}))
    sched.append_token(request, SampledToken(9))
    assert request.num_pending_tokens == 1 and request.all_token_ids[-1] == 9


def test_a_request_whose_pending_token_is_its_last_is_not_planned_again():
    sched = make(num_blocks=32, budget=16)
    sched.add_request(Request("a", [1, 2, 3], SamplingParams(max_tokens=1),
                              eos_token_ids=(EOS,), max_model_len=MAX_MODEL_LEN))
    sched.schedule(ahead=True)
    assert sched.schedule(ahead=True).is_empty  # its one token is the pending one
    blocks = len(sched.kv.req_blocks["a"])
    assert blocks == sched.kv.blocks_needed(3)  # no slot was taken for a token past its end


def test_a_request_preempted_with_a_pending_token_keeps_it_and_recomputes():
    # Two requests, blocks for about one: planning ahead must preempt while a step runs.
    workload = [(0, 12, 10), (0, 12, 10)]
    expected, _, _ = run(workload, num_blocks=7, budget=16, ahead=False)
    got, sched, _ = run(workload, num_blocks=7, budget=16, ahead=True)
    assert got == expected and len(got) == 2
    assert sched.stats.num_preemptions > 0


def test_an_abort_while_a_step_runs_drops_that_steps_tokens_and_frees_every_block():
    sched = make(num_blocks=32, budget=16)
    for rid in ("a", "b"):
        sched.add_request(Request(rid, [1, 2, 3], SamplingParams(max_tokens=8),
                                  eos_token_ids=(EOS,), max_model_len=MAX_MODEL_LEN))
    plan = sched.schedule(ahead=True)
    sched.finish_request("a", FinishReason.ABORT)
    updated = sched.update_from_output(plan, RunnerOutput({"a": [SampledToken(4)],
                                                           "b": [SampledToken(5)]}))
    assert [request.request_id for request, _, _ in updated] == ["b"]
    assert sched.requests["b"].num_pending_tokens == 0
    assert "a" not in sched.kv.req_blocks
    assert sched.requests["b"].status == RequestStatus.RUNNING
