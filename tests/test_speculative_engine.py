"""Speculative decoding in the engine changes speed, never answers: greedy output is the same
token for token (on the real model, at every CPU level, alone and batched, with penalties,
logprobs and stop strings), sampled output keeps its distribution (counted), and blocks
never leak under preemption and aborts."""
from __future__ import annotations

import random

import pytest

from conftest import ISA_LEVELS, amx_off, isa_level
from paged_helpers import run_aborting
from pagedllm import LLM
from pagedllm.config import SpeculativeConfig
from pagedllm.core.request import SamplingParams, SamplingParamsError
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
def plain_real():
    return real("avx512" if "avx512" in ISA_LEVELS else ISA_LEVELS[-1])


@pytest.fixture(scope="module")
def tiny_q4(tmp_path_factory):
    folder = tmp_path_factory.mktemp("spec")
    return write_gguf(tiny_model(7), folder / "tiny.gguf", "Q4_K")


def batches(llm: LLM) -> list[list[str]]:
    """The prompts alone, and together where the model's kernels do not depend on the batch
    size up to 3 sequences. With int8-rounded activations (models from 1B parameters, or
    asked for) a 4-bit layer multiplies up to Q4_EXACT_MAX_ROWS[level] rows exactly and more
    rounded to int8 (quant_linear.py; 1 row below avx512), and on the AMX tiles a 4-bit
    layer multiplies from AMX_EXACT_MIN_ROWS rows there, exactly but summed in another order;
    so there a request's tokens already depend on what runs beside it without speculation,
    and speculation, which changes when the others finish, changes that company."""
    alone = [[p] for p in PROMPTS]
    loop = llm.engine.runner.model.decode_loop
    batch_invariant = min(loop.exact_max_rows) >= len(PROMPTS) and loop.amx_min_rows > len(PROMPTS)
    return alone + [PROMPTS] if batch_invariant else alone


def test_greedy_output_is_the_same_token_for_token_at_every_level(isa, pair):
    plain, fast = pair
    for batch in batches(plain):
        want = generate(plain, batch, max_tokens=64)
        got = generate(fast, batch, max_tokens=64)
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        assert [o.text for o in got] == [o.text for o in want]
        assert [o.finish_reason for o in got] == [o.finish_reason for o in want]
    stats = fast.engine.speculator.stats
    assert stats.num_accepted_tokens > 20, "the quoting prompts must have been sped up"
    assert stats.num_draft_tokens > stats.num_accepted_tokens, "and some proposals refused"
    assert plain.engine.speculator.stats.num_drafts == 0


def test_greedy_is_the_same_with_int8_rounded_prefill(isa):
    """Where large steps round activations to int8, a verification's rows still multiply as
    a plain decode step of its requests would (DecodeLoop: by requests, not rows). Without
    the AMX tiles, which keep every step below 128 rows exact."""
    with isa_level(isa), amx_off():
        plain = LLM(dtype="bfloat16", exact_activations=False, kv_cache_memory=256 << 20)
        fast = LLM(dtype="bfloat16", exact_activations=False, kv_cache_memory=256 << 20,
                   speculative=NGRAM)
    assert min(plain.engine.runner.model.decode_loop.exact_max_rows) < 1 << 62
    for batch in batches(plain):
        want = generate(plain, batch, max_tokens=64)
        got = generate(fast, batch, max_tokens=64)
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert fast.engine.speculator.stats.num_accepted_tokens > 20


def test_penalties_logprobs_and_stop_strings_agree(plain_real):
    """At the host's best level only: what differs between levels is the kernels, which the
    tests above cover at each; this is the sampler's and the stop checks' side."""
    plain, fast = plain_real, real(plain_real.engine.cpu.level, NGRAM)
    accepted = fast.engine.speculator.stats.num_accepted_tokens
    cases = [dict(max_tokens=48, presence_penalty=0.5, repetition_penalty=1.1),
             dict(max_tokens=32, logprobs=3),
             dict(max_tokens=64, stop=["dozen", "return"]),
             dict(max_tokens=32, ignore_eos=True, frequency_penalty=0.3)]
    for params in cases:
        for batch in batches(plain)[-1:] + batches(plain)[:1]:
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


@pytest.mark.parametrize("proposer", ["ngram", "draft"])
def test_blocks_never_leak_under_preemption_and_aborts(tiny_q4, proposer):
    """A pool so small that requests preempt each other, speculation on, some requests
    aborted midway: the survivors' greedy tokens equal a roomy pool without speculation's,
    and every block is free at the end (the draft model's own pool too)."""
    prompts = [[11, 12, 13, 14] * 3 + [20 + i] for i in range(6)]
    roomy = LLM(tiny_q4, dtype="bfloat16", kv_cache_memory=8 << 20)
    want = {tuple(o.prompt_token_ids): o.token_ids
            for o in roomy.generate(prompts, SamplingParams(temperature=0, max_tokens=40))}
    # 1 KiB of KV a token: 32 blocks of 4 tokens, two full-length requests' worth. The
    # draft: the served model itself.
    spec = SpeculativeConfig(method=proposer, num_speculative_tokens=6,
                             draft_model=tiny_q4 if proposer == "draft" else None)
    tight = LLM(tiny_q4, dtype="bfloat16", block_size=4, max_model_len=64, max_num_seqs=6,
                kv_cache_memory=128 << 10, speculative=spec)
    engine = tight.engine
    assert engine.kv_manager.num_blocks == 32
    ids, aborted, done = run_aborting(engine, prompts,
                                      SamplingParams(temperature=0, max_tokens=40))
    assert engine.scheduler.stats.num_preemptions > 0
    assert engine.speculator.stats.num_accepted_tokens > 0
    for rid, prompt in zip(ids, prompts):
        if rid not in aborted:
            assert done[rid].token_ids == want[tuple(prompt)]
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_blocks
    assert all(block.ref_cnt == 0 for block in engine.kv_manager.pool.blocks)
    assert not engine.speculator.states
    draft = engine.speculator.draft
    if draft is not None:
        assert not draft.sequences and draft.kv.num_free_blocks == draft.kv.num_blocks


@pytest.mark.parametrize("proposer", ["ngram", "draft"])
def test_sampling_keeps_its_distribution(tiny_llama_folder, proposer):
    """Temperature 1, biased towards the tokens the prompt repeats so that proposals are
    accepted about one time in five: the joint distribution of tokens 2-4 over (11, 12, 13,
    anything else) is the same with and without speculation (a two-sample chi-square test
    at p = 0.001, on fixed seeds)."""
    prompt = [11, 12, 13] * 4
    bias = {11: 5.0, 12: 5.0, 13: 5.0}  # the tiny model's own logits are O(1)
    counts, stats = {}, {}
    for method in ("off", proposer):
        # The draft: the served model itself, so that its greedy guesses are often right.
        llm = LLM(tiny_llama_folder, max_num_seqs=32, speculative=SpeculativeConfig(
            method=method, max_batch_sequences=64, max_rows=512, num_speculative_tokens=3,
            prompt_lookup_min=1,
            draft_model=str(tiny_llama_folder) if method == "draft" else None))
        engine, tally = llm.engine, {}
        seeds = list(range(3000))
        while seeds or engine.has_unfinished_requests():
            while seeds and len(engine.scheduler.requests) < 32:
                seed = seeds.pop()
                engine.add_request(None, prompt, SamplingParams(
                    temperature=1.0, max_tokens=4, seed=seed * 7919 + (method != "off"),
                    logit_bias=bias, ignore_eos=True))
            for out in engine.step():
                if out.finished:
                    key = tuple(t if t in bias else -1 for t in out.token_ids[1:4])
                    tally[key] = tally.get(key, 0) + 1
        counts[method], stats[method] = tally, engine.speculator.stats
    spec = stats[proposer]
    assert spec.num_draft_tokens > 1000 and 0.1 < spec.acceptance_rate < 0.5
    cells = set(counts["off"]) | set(counts[proposer])
    chi2 = sum((counts["off"].get(c, 0) - counts[proposer].get(c, 0)) ** 2
               / (counts["off"].get(c, 0) + counts[proposer].get(c, 0)) for c in cells)
    assert len(cells) == 64
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


# -- a draft model ------------------------------------------------------------------------------
def random_draft_with_the_real_tokenizer(path) -> str:
    """A 2-layer random model with the default model's tokenizer: its proposals are almost
    always wrong, which must change nothing but the speed."""
    import gguf
    import numpy as np

    from pagedllm.weights import default_model_path

    source = gguf.GGUFReader(default_model_path())
    vocab = len(source.fields["tokenizer.ggml.tokens"].contents())
    writer = gguf.GGUFWriter(str(path), "llama")
    hidden, inter, layers = 64, 128, 2
    for add, value in ((writer.add_context_length, 2048), (writer.add_embedding_length, hidden),
                       (writer.add_block_count, layers), (writer.add_feed_forward_length, inter),
                       (writer.add_head_count, 4), (writer.add_head_count_kv, 2),
                       (writer.add_rope_freq_base, 10000.0), (writer.add_layer_norm_rms_eps, 1e-5)):
        add(value)
    for name, field in source.fields.items():
        if name.startswith("tokenizer."):
            value = field.contents()
            if isinstance(value, list):
                writer.add_array(name, value)
            elif isinstance(value, str):
                writer.add_string(name, value)
            else:
                writer.add_uint32(name, int(value))
    rng = np.random.default_rng(0)

    def matrix(rows, cols):
        return (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32)

    writer.add_tensor("token_embd.weight", matrix(vocab, hidden))
    writer.add_tensor("output_norm.weight", np.ones(hidden, dtype=np.float32))
    for layer in range(layers):
        for name, shape in {"attn_q": (hidden, hidden), "attn_k": (32, hidden),
                            "attn_v": (32, hidden), "attn_output": (hidden, hidden),
                            "ffn_gate": (inter, hidden), "ffn_up": (inter, hidden),
                            "ffn_down": (hidden, inter)}.items():
            writer.add_tensor(f"blk.{layer}.{name}.weight", matrix(*shape))
        writer.add_tensor(f"blk.{layer}.attn_norm.weight", np.ones(hidden, dtype=np.float32))
        writer.add_tensor(f"blk.{layer}.ffn_norm.weight", np.ones(hidden, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def draft_config(path, **extra) -> SpeculativeConfig:
    return SpeculativeConfig(method="draft", draft_model=str(path), **extra)


@pytest.fixture(scope="module")
def random_draft(tmp_path_factory):
    return random_draft_with_the_real_tokenizer(tmp_path_factory.mktemp("draft") / "draft.gguf")


def test_a_draft_model_changes_nothing_but_the_speed(plain_real, random_draft):
    from pagedllm.weights import default_model_path

    level = plain_real.engine.cpu.level
    for draft, good in ((default_model_path(), True), (random_draft, False)):
        fast = real(level, draft_config(draft))
        for batch in batches(plain_real):
            want = generate(plain_real, batch, max_tokens=64)
            got = generate(fast, batch, max_tokens=64)
            assert [o.token_ids for o in got] == [o.token_ids for o in want], draft
        stats = fast.engine.speculator.stats
        assert stats.num_draft_tokens > 50
        if good:  # the served model drafting for itself: nearly every proposal holds
            assert stats.acceptance_rate > 0.8
        else:
            assert stats.acceptance_rate < 0.2
        draft_pool = fast.engine.speculator.draft.kv
        assert not fast.engine.speculator.draft.sequences
        assert draft_pool.num_free_blocks == draft_pool.num_blocks
        assert fast.engine.kv_manager.num_free_blocks == fast.engine.kv_manager.num_blocks


def test_draft_settings_are_checked(tiny_q4, tiny_llama_folder):
    with pytest.raises(ValueError, match="needs a draft model"):
        SpeculativeConfig(method="draft")
    with pytest.raises(ValueError, match="share the served model's tokenizer"):
        LLM(tiny_q4, dtype="bfloat16", speculative=draft_config(tiny_llama_folder))
    plain = LLM(tiny_q4, dtype="bfloat16")
    with pytest.raises(SamplingParamsError) as err:
        plain.engine.add_request(None, [1, 2, 3], SamplingParams(speculative="draft"))
    assert err.value.param == "speculative" and "no draft model" in str(err.value)


def test_structured_output_speculates_and_keeps_its_tokens(plain_real):
    """A JSON schema's request verifies proposals too: each position is sampled under the
    grammar's mask after the proposals before it; the tokens are the same as without."""
    import json

    from pagedllm.structured.spec import json_schema_spec

    schema = {"type": "array", "minItems": 4, "maxItems": 4, "items": {
        "type": "object", "properties": {"name": {"type": "string"}, "city": {"type": "string"}},
        "required": ["name", "city"], "additionalProperties": False}}
    prompt = plain_real.tokenizer.apply_chat_template([{"role": "user", "content":
        "List four people with their city as JSON: [{\"name\": ..., \"city\": ...}, ...]"}])
    fast = real(plain_real.engine.cpu.level, NGRAM)
    outs = {}
    for name, llm in (("plain", plain_real), ("fast", fast)):
        for temperature in (0.0, 0.8):
            params = SamplingParams(temperature=temperature, seed=5, max_tokens=160,
                                    guided=json_schema_spec(schema, "response_format"))
            outs[name, temperature] = llm.generate([prompt], params)[0]
    assert outs["fast", 0.0].token_ids == outs["plain", 0.0].token_ids
    for key, out in outs.items():
        if out.finish_reason == "stop":
            assert len(json.loads(out.text)) == 4, key  # the schema holds, proposals or not
    stats = fast.engine.speculator.stats
    assert stats.num_accepted_tokens > 10
