"""The budget of a step in which no request decodes (SchedulerConfig.prefill_alone_tokens):
a prompt is prefilled in larger steps while nobody waits on a next token, and the usual
budget bounds every step in which someone does. Scheduler with a fake runner (no torch),
and the engine config that sets it."""
import pytest

from pagedllm.config import (DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_PREFILL_ALONE_TOKENS,
                             GPU_MAX_NUM_BATCHED_TOKENS, EngineConfig, SchedulerConfig)
from pagedllm.core.kv_cache import KVCacheManager
from pagedllm.core.scheduler import Scheduler
from test_scheduler import check_invariants, fake_step, req
from test_scheduler import make as make_scheduler


def make(budget=16, alone=40, num_blocks=64, max_seqs=8):
    return make_scheduler(num_blocks, 4, budget, max_seqs, prefill_alone_tokens=alone)


def new_tokens(out) -> dict[str, int]:
    return {s.request_id: s.num_new_tokens for s in out.scheduled}


def test_a_prompt_alone_takes_the_larger_budget():
    sched = make()
    sched.add_request(req("a", 50, max_tokens=3))
    assert new_tokens(fake_step(sched)) == {"a": 40}  # nobody decodes: 40, not 16
    check_invariants(sched)
    assert new_tokens(fake_step(sched)) == {"a": 10}  # still prefilling
    assert new_tokens(fake_step(sched)) == {"a": 1}  # decoding
    while sched.has_unfinished_requests():
        fake_step(sched)
    assert sched.kv.num_free_blocks == sched.kv.num_blocks


def test_two_prompts_arriving_together_share_the_larger_budget():
    sched = make()
    sched.add_request(req("a", 30, max_tokens=2))
    sched.add_request(req("b", 30, max_tokens=2, start=100))
    assert new_tokens(fake_step(sched)) == {"a": 30, "b": 10}
    assert new_tokens(fake_step(sched)) == {"a": 1, "b": 15}  # a decodes: the usual 16


def test_while_a_request_decodes_every_step_keeps_the_usual_budget():
    sched = make()
    sched.add_request(req("a", 8, max_tokens=30))
    fake_step(sched)  # a's prompt
    sched.add_request(req("b", 100, max_tokens=2, start=200))
    for _ in range(5):
        out = fake_step(sched)
        assert out.num_scheduled_tokens <= 16 and new_tokens(out)["a"] == 1
        check_invariants(sched)


def test_a_preempted_request_recomputing_counts_as_decoding():
    sched = make(budget=16, alone=64, num_blocks=12)
    sched.add_request(req("a", 12, max_tokens=20))
    sched.add_request(req("b", 12, max_tokens=20, start=100))
    preempted = False
    for _ in range(30):
        out = fake_step(sched)
        check_invariants(sched)
        if "b" in out.preempted:
            preempted = True
            break
    assert preempted
    while "a" in sched.requests and sched.has_unfinished_requests():
        fake_step(sched)  # a finishes; b (with answers already) waits to recompute
    b = sched.requests["b"]
    assert b.num_output_tokens > 0
    out = fake_step(sched)
    assert new_tokens(out)["b"] <= 16  # its client waits on a token: not the larger budget


def test_without_an_alone_budget_every_step_has_the_one_budget():
    kv = KVCacheManager(64, 4, True)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=16,
                                      max_model_len=10_000), kv)
    sched.add_request(req("a", 50, max_tokens=2))
    assert new_tokens(fake_step(sched)) == {"a": 16}
    assert SchedulerConfig(max_num_batched_tokens=16).largest_step == 16
    assert SchedulerConfig(max_num_batched_tokens=16, prefill_alone_tokens=40).largest_step == 40


@pytest.mark.parametrize("given, device, step, alone", [
    (None, "cpu", DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_PREFILL_ALONE_TOKENS),
    (None, "cuda", GPU_MAX_NUM_BATCHED_TOKENS, GPU_MAX_NUM_BATCHED_TOKENS),
    (128, "cpu", 128, 128),  # a budget the user gives bounds every step
    (1024, "cpu", 1024, 1024),
])
def test_the_engine_config_sets_the_larger_budget_only_by_default_on_a_cpu(given, device, step, alone):
    config = EngineConfig(max_num_batched_tokens=given)
    assert config.step_budget(device) == step and config.prefill_alone_budget(device) == alone


def test_the_engine_built_here_has_both_budgets():
    from pagedllm.engine.engine import LLMEngine

    engine = LLMEngine(None, dtype="bfloat16", kv_cache_memory=32 << 20, max_model_len=1024)
    config = engine.scheduler.config
    assert config.max_num_batched_tokens == DEFAULT_MAX_NUM_BATCHED_TOKENS
    assert config.prefill_alone_tokens == DEFAULT_PREFILL_ALONE_TOKENS
    given = LLMEngine(None, dtype="bfloat16", kv_cache_memory=32 << 20, max_model_len=1024,
                      max_num_batched_tokens=64)
    assert given.scheduler.config.largest_step == 64
