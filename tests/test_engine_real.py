"""The engine on the real default model: continuous batching, preemption, prefix caching."""
import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.core.output_budget import OutputCaps, PromptTooLongError
from pagedllm.tools.text_prompts import make_prompt_token_ids

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
LENGTHS = [30, 600, 75, 250, 140, 410, 45, 330]
PREEMPTED_LENGTHS = [n // 2 for n in LENGTHS]  # (a smaller pool preempts at half the cost)


def run_until_done(engine):
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    return finished


def test_preemption_keeps_outputs_exact(real_llm):
    prompts = make_prompt_token_ids(real_llm.tokenizer, PREEMPTED_LENGTHS, seed=1)
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    expected = [o.token_ids for o in real_llm.generate(prompts, params)]
    # 26 blocks of 16 tokens (46080 bytes a token in float32): the 300-token request alone
    # grows to 21 blocks, so the others must be preempted while it decodes.
    small = LLM(dtype="float32", kv_cache_memory=26 * 16 * 46080, max_model_len=400, max_num_seqs=8)
    assert small.engine.cache_config.num_blocks == 26
    outputs = small.generate(prompts, params)
    assert small.engine.stats().num_preemptions > 0
    assert [o.token_ids for o in outputs] == expected
    assert small.engine.kv_manager.num_free_blocks == 26


def test_request_added_mid_run_joins_next_step_and_finishes_first(real_llm):
    engine = real_llm.engine
    long_prompt, short_prompt = make_prompt_token_ids(real_llm.tokenizer, [500, 30], seed=2)
    engine.add_request("long", long_prompt, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    engine.step()
    engine.step()
    engine.add_request("short", short_prompt, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    outs = engine.step()
    assert "short" in {o.request_id for o in outs}  # prefilled and sampled in the very next step
    order = []
    while engine.has_unfinished_requests():
        order += [o.request_id for o in engine.step() if o.finished]
    assert order == ["short", "long"]


def test_shared_prefix_is_served_from_cache(real_llm):
    tok = real_llm.tokenizer
    prefix = make_prompt_token_ids(tok, [256], seed=3)[0]
    first = prefix + tok.encode(" Question one: what happened?")
    second = prefix + tok.encode(" Question two: who was there?")
    params = SamplingParams(max_tokens=12, temperature=0.0)
    out1 = real_llm.generate([first], params)[0]
    out2 = real_llm.generate([second], params)[0]
    assert out2.num_cached_tokens >= 240
    # Unchanged output: compare with a fresh engine that has no cache.
    fresh = LLM(dtype="float32", kv_cache_memory=128 << 20, enable_prefix_caching=False)
    assert fresh.generate([second], params)[0].token_ids == out2.token_ids
    assert fresh.generate([first], params)[0].num_cached_tokens == 0
    assert out1.text


def test_blocks_held_equal_tokens_over_block_size(real_llm):
    engine = real_llm.engine
    engine.kv_manager.pool.reset_prefix_cache()
    prompts = make_prompt_token_ids(real_llm.tokenizer, [33, 100, 17, 64], seed=4)
    for i, p in enumerate(prompts):
        engine.add_request(f"kv{i}", p, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    bs = engine.cache_config.block_size
    for _ in range(6):
        engine.step()
        held = sum(len(engine.kv_manager.block_table(r.request_id)) for r in engine.scheduler.running)
        expected = sum(-(-r.num_computed_tokens // bs) for r in engine.scheduler.running)
        assert held == expected == engine.kv_manager.pool.num_used_blocks
    run_until_done(engine)
    assert engine.kv_manager.pool.num_used_blocks == 0


def test_stop_strings_are_cut_even_across_tokens(real_llm):
    base = real_llm.generate(["1, 2, 3, 4,"], SamplingParams(max_tokens=20, temperature=0))[0]
    assert base.text.startswith(" 5, 6, 7")
    # ", 7" spans several tokens; neither it nor what follows is returned.
    out = real_llm.generate(["1, 2, 3, 4,"], SamplingParams(max_tokens=20, temperature=0, stop=[", 7"]))[0]
    assert out.text == " 5, 6"
    assert out.finish_reason == "stop"


def test_stop_token_ids_and_max_tokens(real_llm):
    base = real_llm.generate(["1, 2, 3, 4,"], SamplingParams(max_tokens=6, temperature=0))[0]
    assert base.finish_reason == "length" and len(base.token_ids) == 6
    stop_at = base.token_ids[2]
    out = real_llm.generate(["1, 2, 3, 4,"], SamplingParams(max_tokens=6, temperature=0,
                                                             stop_token_ids=[stop_at]))[0]
    assert out.token_ids == base.token_ids[:3] and out.finish_reason == "stop"


def test_eos_stops_unless_ignored(real_llm):
    tok = real_llm.tokenizer
    prompt = tok.apply_chat_template([{"role": "user", "content": "Say hi."}])
    out = real_llm.generate([prompt], SamplingParams(max_tokens=200, temperature=0))[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] in tok.eos_token_ids
    assert "<|im_end|>" not in out.text
    ignored = real_llm.generate([prompt], SamplingParams(max_tokens=len(out.token_ids) + 5,
                                                         temperature=0, ignore_eos=True))[0]
    assert ignored.finish_reason == "length"


def test_context_length_limit(real_llm):
    engine = real_llm.engine
    max_len = engine.scheduler_config.max_model_len
    with pytest.raises(PromptTooLongError) as info:
        engine.add_request(None, [5] * (max_len - 3), SamplingParams(max_tokens=10))
    assert str(max_len) in str(info.value) and str(max_len - 3) in str(info.value)


def test_abort_frees_blocks_at_once(real_llm):
    engine = real_llm.engine
    (prompt,) = make_prompt_token_ids(real_llm.tokenizer, [200], seed=5)
    engine.add_request("abort-me", prompt, SamplingParams(max_tokens=50, temperature=0))
    engine.step()
    assert engine.kv_manager.pool.num_used_blocks > 0
    final = engine.abort_request("abort-me")
    assert final.finished and final.finish_reason == "abort"
    assert engine.kv_manager.pool.num_used_blocks == 0
    assert not engine.has_unfinished_requests()


def test_token_id_prompts_and_bad_prompts(real_llm):
    ids = real_llm.tokenizer.encode("Hello there")
    assert real_llm.generate([ids], GREEDY)[0].prompt_token_ids == ids
    with pytest.raises(ValueError, match="token ids"):
        real_llm.engine.add_request(None, [10**9], GREEDY)
    with pytest.raises(ValueError, match="empty"):
        real_llm.engine.add_request(None, "", GREEDY)


def test_seeded_sampling_is_reproducible_in_any_batch(real_llm):
    params = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=1234)
    alone = real_llm.generate(["Tell me a story about"], params)[0]
    others = SamplingParams(max_tokens=12, temperature=1.0)
    batch = real_llm.generate(["Once", "Tell me a story about", "Why is"], params)
    mixed_engine = real_llm.engine
    mixed_engine.add_request("x", "Noise prompt here", others)
    mixed = real_llm.generate(["Tell me a story about"], params)[0]
    assert batch[1].token_ids == alone.token_ids == mixed.token_ids


def test_logprobs_are_returned(real_llm):
    out = real_llm.generate(["The capital of France is"],
                            SamplingParams(max_tokens=3, temperature=0, logprobs=3))[0]
    assert len(out.logprobs) == 3
    first = out.logprobs[0]
    assert first.token_id == out.token_ids[0] and first.top[0][0] == first.token_id
    assert first.logprob <= 0 and len(first.top) == 3


def test_stats_move(real_llm):
    before = real_llm.engine.stats()
    real_llm.generate(["Counting tokens"], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    after = real_llm.engine.stats()
    assert after.num_generation_tokens == before.num_generation_tokens + 5
    assert after.num_prompt_tokens > before.num_prompt_tokens
    assert after.prefix_cache_queries > before.prefix_cache_queries
    assert after.kv_blocks_total == real_llm.engine.cache_config.num_blocks


def test_server_limit_caps_an_open_ended_request(real_llm):
    engine = real_llm.engine
    caps = OutputCaps(engine.scheduler_config.max_model_len, server_limit=5)
    open_ended = engine.make_request(None, "Hi", SamplingParams(max_tokens=None), caps=caps)
    assert open_ended.max_tokens == 5
    uncapped = engine.make_request(None, "Hi", SamplingParams(max_tokens=None))
    assert uncapped.max_tokens == engine.scheduler_config.max_model_len - uncapped.num_prompt_tokens
