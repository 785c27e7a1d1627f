"""Continuous-batching scheduler with a fake model runner: no torch, milliseconds."""
from collections import Counter

from hypothesis import given, settings, strategies as st

from pagedllm.config import SchedulerConfig
from pagedllm.core.kv_cache import KVCacheManager
from pagedllm.core.output_processor import token_stop_reason
from pagedllm.core.request import FinishReason, Request, RequestStatus, SamplingParams
from pagedllm.core.scheduler import Scheduler
from pagedllm.core.step_records import RunnerOutput, SampledToken

EOS = 0


def make(num_blocks=64, block_size=4, budget=32, max_seqs=8, caching=True, lora_slots=None,
         **config):
    """The scheduler the tests drive (the one builder: the other scheduler tests import it);
    config: any other SchedulerConfig field (max_model_len 10,000 unless given)."""
    kv = KVCacheManager(num_blocks, block_size, caching)
    config.setdefault("max_model_len", 10_000)
    return Scheduler(SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget, **config),
                     kv, *([lora_slots] if lora_slots is not None else []))


def req(rid, n_prompt, max_tokens=4, start=1):
    return Request(rid, list(range(start, start + n_prompt)), SamplingParams(max_tokens=max_tokens),
                   eos_token_ids=(EOS,), max_model_len=10_000)


def fake_step(sched, token=5):
    """Schedule, 'run' the model (every sampling request gets `token`, or token(request)),
    update, and finish what stops at token level, as the engine does."""
    out = sched.schedule()
    sampled = {s.request_id: [SampledToken(token(sched.requests[s.request_id]) if callable(token)
                                           else token)]
               for s in out.scheduled if s.samples}
    for request, tokens, _ in sched.update_from_output(out, RunnerOutput(sampled)):
        for token_ in tokens:
            sched.append_token(request, token_)
            reason = token_stop_reason(request)
            if reason is not None:
                sched.finish_request(request.request_id, reason)
                break
    return out


def check_invariants(sched):
    kv = sched.kv
    refs = Counter()
    for rid, blocks in kv.req_blocks.items():
        request = sched.requests[rid]
        assert request.status == RequestStatus.RUNNING
        # Tables hold exactly the blocks for the computed tokens (after a step).
        assert len(blocks) == kv.blocks_needed(request.num_computed_tokens)
        refs.update(b.block_id for b in blocks)
    for block in kv.pool.blocks:
        assert block.ref_cnt == refs[block.block_id], block
    assert kv.num_free_blocks == kv.num_blocks - len(refs)
    assert {r.request_id for r in sched.running} == set(kv.req_blocks)


def test_prefill_is_chunked_within_budget_and_decode_mixes_in():
    sched = make(budget=10)
    sched.add_request(req("long", 25))
    out = fake_step(sched)
    assert [(s.request_id, s.num_new_tokens) for s in out.scheduled] == [("long", 10)]
    sched.add_request(req("short", 3))
    out = fake_step(sched)
    assert [(s.request_id, s.num_new_tokens) for s in out.scheduled] == [("long", 10)]
    out = fake_step(sched)  # long finishes its prefill (5), short prefills in the same step
    assert [(s.request_id, s.num_new_tokens) for s in out.scheduled] == [("long", 5), ("short", 3)]
    out = fake_step(sched)  # both decode together
    assert [(s.request_id, s.num_new_tokens) for s in out.scheduled] == [("long", 1), ("short", 1)]
    assert all(s.samples for s in out.scheduled)


def test_budget_never_exceeded_and_slots_capped():
    sched = make(budget=16, max_seqs=3)
    for i in range(6):
        sched.add_request(req(f"r{i}", 7 + i))
    for _ in range(40):
        out = fake_step(sched)
        assert out.num_scheduled_tokens <= 16
        assert sched.num_running <= 3
        check_invariants(sched)
    assert not sched.has_unfinished_requests()


def test_new_request_joins_next_step_and_finishes_first():
    sched = make(budget=64)
    sched.add_request(req("old", 20, max_tokens=30))
    fake_step(sched)
    fake_step(sched)
    sched.add_request(req("new", 4, max_tokens=2))
    out = fake_step(sched)
    assert "new" in [s.request_id for s in out.scheduled]
    for _ in range(3):
        fake_step(sched)
    assert "new" not in sched.requests and "old" in sched.requests


def test_stop_conditions():
    sched = make()
    eos, length = req("eos", 3, max_tokens=10), req("len", 3, max_tokens=2, start=50)
    sched.add_request(eos)
    sched.add_request(length)
    fake_step(sched, token=7)
    fake_step(sched, token=lambda r: EOS if r.request_id == "eos" else 7)
    finished = {r.request_id: r.finish_reason for r in (eos, length)}
    assert finished == {"eos": FinishReason.STOP, "len": FinishReason.LENGTH}
    assert sched.kv.num_free_blocks == sched.kv.num_blocks


def test_ignore_eos_and_stop_token_ids():
    r = Request("x", [1, 2], SamplingParams(max_tokens=5, ignore_eos=True, stop_token_ids=[9]),
                eos_token_ids=(EOS,), max_model_len=100)
    r.append_token(EOS)
    assert token_stop_reason(r) is None
    r.append_token(9)
    assert token_stop_reason(r) == FinishReason.STOP


def test_context_length_stops():
    r = Request("x", [1, 2, 3], SamplingParams(max_tokens=None), max_model_len=4)
    r.append_token(5)
    assert token_stop_reason(r) == FinishReason.LENGTH


def test_preemption_newest_first_then_resume_from_cached_prefix():
    sched = make(num_blocks=8, block_size=4, budget=64)
    b = req("b", 12, max_tokens=20, start=100)
    sched.add_request(req("a", 12, max_tokens=8))  # a never needs b's cached prompt blocks
    sched.add_request(b)
    fake_step(sched)  # a: 3 blocks, b: 3 blocks (+1 each soon)
    preempted_at = None
    for step in range(12):
        out = fake_step(sched)
        check_invariants(sched)
        if out.preempted:
            preempted_at = step
            assert out.preempted == ["b"]  # the newest goes
            assert sched.waiting.peek().request_id == "b"
            assert sched.requests["b"].num_computed_tokens == 0
            break
    assert preempted_at is not None
    assert sched.stats.num_preemptions == 1
    resumed_at = []
    while sched.has_unfinished_requests():
        out = fake_step(sched)
        check_invariants(sched)
        resumed_at += [s.start for s in out.scheduled
                       if s.request_id == "b" and s.num_new_tokens > 1]
    assert len(resumed_at) == 1 and resumed_at[0] > 0  # its prefix came back from the cache
    assert sched.kv.num_free_blocks == 8


def test_abort_in_any_state_frees_blocks():
    sched = make(budget=8)
    sched.add_request(req("running", 20))
    sched.add_request(req("waiting", 20, start=40))
    fake_step(sched)
    assert sched.finish_request("running", FinishReason.ABORT).finish_reason == FinishReason.ABORT
    assert sched.finish_request("waiting", FinishReason.ABORT).status == RequestStatus.FINISHED
    assert sched.finish_request("nope", FinishReason.ABORT) is None
    assert sched.kv.num_free_blocks == sched.kv.num_blocks
    assert fake_step(sched).is_empty


def test_fcfs_admission_order():
    sched = make(budget=100, max_seqs=2)
    for name in "abc":
        sched.add_request(req(name, 4))
    out = fake_step(sched)
    assert [s.request_id for s in out.scheduled] == ["a", "b"]


def test_shared_prefix_counts_cache_hits():
    sched = make(budget=100)
    sched.add_request(req("a", 17))
    fake_step(sched)
    sched.add_request(req("b", 17))
    fake_step(sched)
    assert sched.requests["b"].num_cached_tokens == 16
    assert sched.stats.prefix_cache_hits == 16


actions = st.lists(st.tuples(st.sampled_from(["add", "abort", "step", "step", "step"]),
                             st.integers(0, 9), st.integers(1, 40), st.integers(1, 12)),
                   min_size=1, max_size=60)


@settings(max_examples=150, deadline=None)
@given(actions, st.integers(6, 40), st.integers(4, 48), st.booleans())
def test_property_no_leaks_and_exact_reference_counts(ops, num_blocks, budget, caching):
    sched = make(num_blocks=num_blocks, block_size=4, budget=budget, max_seqs=4, caching=caching)
    next_id = 0
    for op, pick, length, max_tokens in ops:
        if op == "add":
            # Prompts of one family share prefixes, so cache hits and shared blocks happen.
            prompt_len = min(length, num_blocks * 4 - max_tokens - 1)
            if prompt_len < 1:
                continue
            r = req(f"r{next_id}", prompt_len, max_tokens=max_tokens, start=1 + (pick % 3))
            next_id += 1
            sched.add_request(r)
        elif op == "abort" and sched.requests:
            ids = sorted(sched.requests)
            sched.finish_request(ids[pick % len(ids)], FinishReason.ABORT)
        else:
            fake_step(sched, token=5 + pick)
        check_invariants(sched)
    for rid in list(sched.requests):
        sched.finish_request(rid, FinishReason.ABORT)
    assert sched.kv.num_free_blocks == num_blocks
    assert all(b.ref_cnt == 0 for b in sched.kv.pool.blocks)


def test_under_memory_pressure_only_an_empty_batch_admits():
    from pagedllm.engine.memory_guard import MemoryGuard

    sched = make()
    sched.add_request(req("a", 8, max_tokens=3))
    sched.add_request(req("b", 8, max_tokens=3, start=100))
    sched.admission_paused = True
    assert [s.request_id for s in fake_step(sched).scheduled] == ["a"]  # progress, one at a time
    assert [s.request_id for s in fake_step(sched).scheduled] == ["a"]  # b still waits
    sched.admission_paused = False
    assert {s.request_id for s in fake_step(sched).scheduled} == {"a", "b"}

    readings = iter([(900, 10_000, 100_000), (900, 9_000, 100_000), (2_000, 5_000, 100_000)])
    clock = iter([0.0, 1.0, 2.0])
    machine = MemoryGuard(None, clock=lambda: next(clock), read=lambda: next(readings))
    assert not machine.under_pressure()  # 10 % free: not under
    assert machine.under_pressure() and "free" in machine.reason  # 9 %: under
    explicit = MemoryGuard(1_000, clock=iter([0.0, 0.1, 5.0]).__next__,
                           read=iter([(999, 0, 1), (2_000, 0, 1)]).__next__)
    assert not explicit.under_pressure()
    assert not explicit.under_pressure()  # read at most every CHECK_EVERY_SECONDS
    assert explicit.under_pressure() and "--max-memory" in explicit.reason
