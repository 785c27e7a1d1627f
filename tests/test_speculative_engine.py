"""Speculative decoding in the engine changes speed, never answers: greedy output is the same
token for token (on the real model, at every CPU level, alone and batched, with penalties,
logprobs and stop strings), sampled output keeps its distribution (counted), and blocks
never leak under preemption and aborts."""
from __future__ import annotations

import random

import pytest

from conftest import isa_level
from pagedllm import LLM
from pagedllm.config import SpeculativeConfig
from pagedllm.core.request import SamplingParams
from pagedllm.models.quant_linear import Q4_EXACT_MAX_ROWS
from test_gguf_low_bit import tiny_model
from tiny_models import write_gguf

NGRAM = SpeculativeConfig(method="ngram")
TEXT = ("The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs. "
        "How vexingly quick daft zebras jump!")
PROMPTS = [
    f"<|im_start|>user\nRepeat this text exactly:\n{TEXT}<|im_end|>\n<|im_start|>assistant\n",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n\n"
    "# the same function again:\ndef fib",
    "The capital of France is",
]


def generate(llm, prompts, **params):
    return [o for o in llm.generate(prompts, SamplingParams(temperature=0, **params))]


def real(level: str, speculative: SpeculativeConfig | None = None) -> LLM:
    with isa_level(level):
        return LLM(dtype="bfloat16", kv_cache_memory=256 << 20,
                   **({"speculative": speculative} if speculative else {}))


@pytest.fixture(scope="module")
def pair(isa):
    """The real model at one CPU level without speculation and with n-gram speculation."""
    return real(isa), real(isa, NGRAM)


@pytest.fixture(scope="module")
def tiny_q4(tmp_path_factory):
    folder = tmp_path_factory.mktemp("spec")
    return write_gguf(tiny_model(7), folder / "tiny.gguf", "Q4_K")


def batches(isa: str) -> list[list[str]]:
    """The prompts together where this level's kernels do not depend on the batch size up
    to 3 sequences; alone elsewhere. Below avx512 a 4-bit layer multiplies one sequence's
    activations exactly and several sequences' rounded to int8 (quant_linear.py), so there a
    request's tokens already depend on what runs beside it without speculation, and
    speculation, which changes when the others finish, changes that company."""
    if Q4_EXACT_MAX_ROWS[isa] >= len(PROMPTS):
        return [[p] for p in PROMPTS] + [PROMPTS]
    return [[p] for p in PROMPTS]


def test_greedy_output_is_the_same_token_for_token_at_every_level(isa, pair):
    plain, fast = pair
    for batch in batches(isa):
        want = generate(plain, batch, max_tokens=96)
        got = generate(fast, batch, max_tokens=96)
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        assert [o.text for o in got] == [o.text for o in want]
        assert [o.finish_reason for o in got] == [o.finish_reason for o in want]
    stats = fast.engine.speculator.stats
    assert stats.num_accepted_tokens > 20, "the quoting prompts must have been sped up"
    assert stats.num_draft_tokens > stats.num_accepted_tokens, "and some proposals refused"
    assert plain.engine.speculator.stats.num_drafts == 0


def test_penalties_logprobs_and_stop_strings_agree(isa, pair):
    plain, fast = pair
    accepted = fast.engine.speculator.stats.num_accepted_tokens
    cases = [dict(max_tokens=64, presence_penalty=0.5, repetition_penalty=1.1),
             dict(max_tokens=48, logprobs=3),
             dict(max_tokens=96, stop=["dozen", "return"]),
             dict(max_tokens=40, ignore_eos=True, frequency_penalty=0.3)]
    for params in cases:
        for batch in batches(isa)[-1:] + batches(isa)[:1]:
            want = generate(plain, batch, **params)
            got = generate(fast, batch, **params)
            for a, b in zip(got, want):
                assert (a.token_ids, a.text, a.finish_reason, a.stop_string) == \
                       (b.token_ids, b.text, b.finish_reason, b.stop_string), params
                if params.get("logprobs"):
                    assert a.logprobs == b.logprobs
    assert fast.engine.speculator.stats.num_accepted_tokens > accepted


def test_a_request_chooses_for_itself(pair):
    server_off, server_on = pair
    want = generate(server_off, PROMPTS[:1], max_tokens=64)[0].token_ids
    before = server_off.engine.speculator.stats.num_accepted_tokens
    params = SamplingParams(temperature=0, max_tokens=64, speculative="ngram")
    assert server_off.generate(PROMPTS[:1], params)[0].token_ids == want
    assert server_off.engine.speculator.stats.num_accepted_tokens > before
    before = server_on.engine.speculator.stats.num_drafts
    params = SamplingParams(temperature=0, max_tokens=64, speculative="off")
    assert server_on.generate(PROMPTS[:1], params)[0].token_ids == want
    assert server_on.engine.speculator.stats.num_drafts == before


def test_blocks_never_leak_under_preemption_and_aborts(tiny_q4):
    """A pool so small that requests preempt each other, speculation on, some requests
    aborted midway: the survivors' greedy tokens equal a roomy pool without speculation's,
    and every block is free at the end."""
    prompts = [[11, 12, 13, 14] * 3 + [20 + i] for i in range(6)]
    roomy = LLM(tiny_q4, dtype="bfloat16", kv_cache_memory=8 << 20)
    want = {tuple(o.prompt_token_ids): o.token_ids
            for o in roomy.generate(prompts, SamplingParams(temperature=0, max_tokens=40))}
    # 1 KiB of KV a token: 32 blocks of 4 tokens, two full-length requests' worth.
    tight = LLM(tiny_q4, dtype="bfloat16", block_size=4, max_model_len=64, max_num_seqs=6,
                kv_cache_memory=128 << 10,
                speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=6))
    engine = tight.engine
    assert engine.kv_manager.num_blocks == 32
    ids = [engine.add_request(None, p, SamplingParams(temperature=0, max_tokens=40)).request_id
           for p in prompts]
    aborted, done, step = {ids[1], ids[4]}, {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        step += 1
        if step == 6:
            for rid in aborted:
                engine.abort_request(rid)
    assert engine.scheduler.stats.num_preemptions > 0
    assert engine.speculator.stats.num_accepted_tokens > 0
    for rid, prompt in zip(ids, prompts):
        if rid not in aborted:
            assert done[rid].token_ids == want[tuple(prompt)]
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_blocks
    assert all(block.ref_cnt == 0 for block in engine.kv_manager.pool.blocks)
    assert not engine.speculator.states


def test_sampling_keeps_its_distribution(tiny_llama_folder):
    """Temperature 1, biased towards the tokens the prompt repeats so that proposals are
    accepted about one time in five: the joint distribution of tokens 2-4 over (11, 12, 13,
    anything else) is the same with and without speculation (a two-sample chi-square test
    at p = 0.001, on fixed seeds)."""
    prompt = [11, 12, 13] * 4
    bias = {11: 5.0, 12: 5.0, 13: 5.0}  # the tiny model's own logits are O(1)
    counts, stats = {}, {}
    for method in ("off", "ngram"):
        llm = LLM(tiny_llama_folder, max_num_seqs=32, speculative=SpeculativeConfig(
            method=method, max_batch_sequences=64, max_rows=512, num_speculative_tokens=3,
            prompt_lookup_min=1))
        engine, tally = llm.engine, {}
        seeds = list(range(3000))
        while seeds or engine.has_unfinished_requests():
            while seeds and len(engine.scheduler.requests) < 32:
                seed = seeds.pop()
                engine.add_request(None, prompt, SamplingParams(
                    temperature=1.0, max_tokens=4, seed=seed * 7919 + (method == "ngram"),
                    logit_bias=bias, ignore_eos=True))
            for out in engine.step():
                if out.finished:
                    key = tuple(t if t in bias else -1 for t in out.token_ids[1:4])
                    tally[key] = tally.get(key, 0) + 1
        counts[method], stats[method] = tally, engine.speculator.stats
    spec = stats["ngram"]
    assert spec.num_draft_tokens > 1000 and 0.1 < spec.acceptance_rate < 0.5
    cells = set(counts["off"]) | set(counts["ngram"])
    chi2 = sum((counts["off"].get(c, 0) - counts["ngram"].get(c, 0)) ** 2
               / (counts["off"].get(c, 0) + counts["ngram"].get(c, 0)) for c in cells)
    assert len(cells) == 64
    print(f"chi2 {chi2:.1f} acceptance {spec.acceptance_rate:.3f} drafts {spec.num_draft_tokens}")
    assert chi2 < 103.4, f"chi-square {chi2:.1f} over 63 degrees of freedom"  # p = 0.001


def test_switched_off_for_a_large_batch(tiny_q4):
    llm = LLM(tiny_q4, dtype="bfloat16", max_num_seqs=16,
              speculative=SpeculativeConfig(method="ngram", max_batch_sequences=4))
    prompts = [[11, 12, 13, 14] * 3 + [30 + i] for i in range(12)]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8))
    assert llm.engine.speculator.stats.num_drafts == 0
    rng = random.Random(0)
    llm.generate(rng.sample(prompts, 2), SamplingParams(temperature=0, max_tokens=16))
    assert llm.engine.speculator.stats.num_drafts > 0
