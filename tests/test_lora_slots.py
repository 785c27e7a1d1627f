"""LoRA slot bookkeeping and the scheduler with adapters: pure Python, no model."""
import pytest

from pagedllm.config import LoRAConfig, SchedulerConfig
from pagedllm.core.kv_cache import KVCacheManager
from pagedllm.core.lora_slot_table import LoRASlotTable
from pagedllm.core.request import FinishReason, Request, SamplingParams, SamplingParamsError
from pagedllm.core.scheduler import Scheduler
from test_scheduler import fake_step
from test_scheduler import make as make_scheduler


def test_a_resident_adapter_keeps_its_slot_and_is_not_loaded_again():
    table = LoRASlotTable(2)
    assert table.acquire("a") == table.acquire("a") == 0
    assert table.acquire("b") == 1
    assert table.num_loads == 2
    table.release("a")
    table.release("a")
    assert table.acquire("a") == 0  # idle, still resident: no copy
    assert table.num_loads == 2


def test_the_least_recently_used_idle_adapter_is_evicted_never_one_in_use():
    table = LoRASlotTable(2)
    table.acquire("a"), table.acquire("b")
    assert not table.can_acquire("c")  # both in use
    table.release("b")
    assert table.can_acquire("c")
    assert table.acquire("c") == 1  # b's slot: a is in use
    assert "b" not in table.slot_of and table.slot_of["a"] == 0
    table.release("a"), table.release("c")
    table.acquire("c"), table.release("c")  # c used more recently than a
    assert table.acquire("d") == 0  # a was the least recently used
    assert table.num_loads == 4


def test_an_unloaded_adapter_frees_its_slot_once_its_requests_end():
    table = LoRASlotTable(1)
    table.acquire("a")
    table.forget("a")  # in use: stays until released
    assert table.slot_of == {"a": 0}
    table.release("a")  # its last request: the slot is free
    assert table.slot_of == {} and table.can_acquire("b")
    table.acquire("a"), table.release("a")
    table.forget("a")  # idle: freed at once
    assert table.slot_of == {}
    table.acquire("a"), table.forget("a"), table.acquire("a")  # loaded again meanwhile
    table.release("a"), table.release("a")
    assert table.slot_of == {"a": 0}


def make(num_slots=1):
    return make_scheduler(64, 4, 64, 8, lora_slots=LoRASlotTable(num_slots))


def req(rid, adapter=None, prompt=(1, 2, 3, 4, 5, 6, 7, 8, 9), max_tokens=3, scale=1.0):
    request = Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens, lora=adapter,
                                                       lora_scale=scale),
                      eos_token_ids=(0,), max_model_len=10_000)
    request.lora_key = None if adapter is None else f"{adapter}@digest"
    return request


def test_a_step_carries_each_requests_slot_and_scale():
    sched = make(num_slots=2)
    for request in (req("base"), req("a", "a", scale=0.5), req("b", "b")):
        sched.add_request(request)
    plan = {s.request_id: (s.lora_slot, s.lora_scale) for s in sched.schedule().scheduled}
    assert plan == {"base": (-1, 1.0), "a": (0, 0.5), "b": (1, 1.0)}


def test_a_request_whose_adapter_finds_no_slot_waits_and_others_pass_it():
    sched = make(num_slots=1)
    sched.add_request(req("a1", "a"))
    sched.add_request(req("b1", "b"))  # the one slot is a's
    sched.add_request(req("base", None))
    sched.add_request(req("a2", "a"))  # a's slot is shared
    first = {s.request_id for s in sched.schedule().scheduled}
    # FairQueue: one user, one queue; b1 heads it after a1, so it blocks base and a2 behind it
    assert first == {"a1"}
    while "b1" not in {s.request_id for s in fake_step(sched).scheduled}:
        pass
    assert sched.lora_slots.slot_of == {"b@digest": 0}  # a was evicted once idle
    while sched.has_unfinished_requests():
        fake_step(sched)
    assert sched.lora_slots.in_use() == {}


def test_users_behind_a_blocked_adapter_are_not_held_up():
    sched = make(num_slots=1)
    a1, b1, base = req("a1", "a"), req("b1", "b"), req("base")
    b1.user, base.user = "bob", "carol"
    for request in (a1, b1, base):
        sched.add_request(request)
    assert {s.request_id for s in sched.schedule().scheduled} == {"a1", "base"}


def test_finishing_and_preempting_give_the_slot_back():
    sched = make(num_slots=1)
    sched.add_request(req("a1", "a"))
    sched.schedule()
    assert sched.lora_slots.in_use() == {"a@digest": 1}
    sched.finish_request("a1", FinishReason.ABORT)
    assert sched.lora_slots.in_use() == {}
    # Four blocks of 4: the base's request and an adapter's fill them; when the base needs
    # a block to decode, the newest (the adapter's) is preempted, and its slot is free.
    kv = KVCacheManager(4, 4, False)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64,
                                      max_model_len=10_000), kv, LoRASlotTable(1))
    sched.add_request(req("base", None, prompt=tuple(range(1, 9)), max_tokens=8))
    sched.add_request(req("a1", "a", prompt=tuple(range(1, 9)), max_tokens=8))
    preempted = []
    while not preempted:
        preempted = fake_step(sched).preempted
    assert preempted == ["a1"] and sched.lora_slots.in_use() == {}


def test_an_adapters_blocks_are_never_another_adapters_or_the_bases():
    sched = make(num_slots=2)
    prompt = tuple(range(1, 18))  # four full blocks of 4
    first = req("a1", "a", prompt)
    sched.add_request(first)
    while not first.is_finished:
        fake_step(sched)
    for rid, adapter, cached in (("b1", "b", 0), ("base", None, 0), ("a2", "a", 16)):
        request = req(rid, adapter, prompt)
        sched.add_request(request)
        sched.schedule()
        assert request.num_cached_tokens == cached, rid
        sched.finish_request(rid, FinishReason.ABORT)


def test_the_prefix_key_joins_the_users_salt_and_the_adapter():
    request = req("x", "a")
    request.cache_salt = "user:1"
    assert request.prefix_cache_key == "user:1\x00lora:a@digest"
    assert req("y").prefix_cache_key is None


@pytest.mark.parametrize("scale", [11.0, -11.0, float("nan"), float("inf")])
def test_an_adapter_scale_out_of_range_is_refused_by_name(scale):
    with pytest.raises(SamplingParamsError) as err:
        SamplingParams(lora="a", lora_scale=scale)
    assert err.value.param == "lora"


@pytest.mark.parametrize("settings, message", [
    ({"max_loras": 0}, "max_loras"), ({"max_lora_rank": 0}, "max_lora_rank"),
    ({"adapters": (("a", "x"), ("a", "y"))}, "names must differ")])
def test_bad_lora_settings_are_refused(settings, message):
    with pytest.raises(ValueError, match=message):
        LoRAConfig(**settings)
