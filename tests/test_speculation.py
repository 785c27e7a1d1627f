"""Speculative decoding's bookkeeping without a model: n-gram proposals, the adaptive k, the
scheduler planning proposals, verification keeping tokens, and blocks given back exactly."""
import random

import pytest
from hypothesis import given, settings, strategies as st

from pagedllm.config import SpeculativeConfig
from pagedllm.core.output_processor import token_stop_reason
from pagedllm.core.request import FinishReason, Request, SamplingParams, SamplingParamsError
from pagedllm.core.speculation import NgramIndex, SpeculationStats, Speculator
from pagedllm.core.step_records import RunnerOutput, SampledToken
from pagedllm.engine.sampler import SamplingRow
from pagedllm.engine.verify import accepted_tokens, verification_rows
from test_scheduler import EOS, check_invariants, make


# -- n-gram proposals -----------------------------------------------------------------------
def propose(tokens, k=4, max_n=4, min_n=2):
    return NgramIndex().propose(list(tokens), k, max_n, min_n)


def test_ngram_proposes_what_followed_the_longest_recent_match():
    tokens = [1, 2, 3, 4, 5, 9, 2, 3, 4, 6, 1, 2, 3, 4]
    assert propose(tokens) == [5, 9, 2, 3]  # "1 2 3 4" occurred once, at the start
    assert propose(tokens, max_n=3) == [6, 1, 2, 3]  # the newest "2 3 4"
    # Only a 2-gram matches (3 4 earlier, not 2 3 4): the newest of its occurrences.
    assert propose([3, 4, 7, 8, 3, 4, 5, 0, 9, 3, 4]) == [5, 0, 9, 3]


def test_ngram_prefers_the_longer_match_over_the_newer_one():
    tokens = [1, 2, 3, 50, 51, 7, 3, 60, 61, 1, 2, 3]
    assert propose(tokens, k=2) == [50, 51]  # "1 2 3" beats the newer "3"-ending "7 3"


def test_ngram_needs_min_n_and_room_after_the_match():
    assert propose([5, 6, 7, 8, 6], min_n=2) == []  # only a 1-gram matches
    assert propose([5, 6, 7, 8, 6], min_n=1) == [7, 8, 6]
    assert propose([1, 2, 1, 2], k=0) == []
    assert propose([1]) == []
    assert propose([]) == []
    assert propose([1, 2, 1, 2], k=10) == [1, 2]  # what follows, up to the end


def test_ngram_index_grows_with_the_request():
    index, tokens = NgramIndex(), [1, 2, 3]
    assert index.propose(tokens, 3, 3, 1) == []
    tokens += [1, 2]
    assert index.propose(tokens, 3, 3, 1) == [3, 1, 2]
    tokens += [3, 9]
    assert index.propose(tokens, 3, 3, 1) == []
    tokens += [1, 2, 3]
    assert index.propose(tokens, 3, 3, 1) == [9, 1, 2]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 4), min_size=0, max_size=40), st.integers(1, 5),
       st.integers(1, 4), st.integers(0, 3))
def test_ngram_index_matches_a_plain_search(tokens, k, max_n, extra):
    """The index gives what a scan from the newest position back gives."""
    min_n = max(1, max_n - extra)

    def plain():
        for n in range(max_n, min_n - 1, -1):
            if len(tokens) < n + 1:
                continue
            tail = tokens[-n:]
            for end in range(len(tokens) - 2, n - 2, -1):
                if tokens[end - n + 1:end + 1] == tail:
                    return tokens[end + 1:end + 1 + k]
        return []

    index = NgramIndex(max_candidates=1000)
    for cut in (len(tokens) // 2, len(tokens)):  # grown in two steps, as a request grows
        index.propose(tokens[:cut], k, max_n, min_n)
    assert index.propose(tokens, k, max_n, min_n) == plain()


# -- the speculator --------------------------------------------------------------------------
def running_request(rid, tokens, max_tokens=100, **params):
    request = Request(rid, tokens, SamplingParams(max_tokens=max_tokens, **params),
                      max_model_len=1000)
    request.num_computed_tokens = len(tokens) - 1
    return request


def test_speculator_proposes_for_decoding_requests_within_their_room():
    spec = Speculator(SpeculativeConfig(method="ngram", num_speculative_tokens=3))
    quoting = running_request("a", [1, 2, 3, 4, 5, 6, 1, 2])
    near_end = running_request("b", [1, 2, 3, 4, 5, 6, 1, 2], max_tokens=2)
    near_end.all_token_ids.append(1)  # one output token: 1 more may come, so no proposal
    near_end.num_computed_tokens += 1
    prefilling = running_request("c", [1, 2, 3, 1, 2])
    prefilling.num_computed_tokens = 2
    own_off = running_request("d", [1, 2, 3, 1, 2], speculative="off")
    spec.propose([quoting, near_end, prefilling, own_off])
    assert quoting.draft_token_ids == [3, 4, 5]
    assert near_end.draft_token_ids == [] and prefilling.draft_token_ids == []
    assert own_off.draft_token_ids == []
    # A request may ask for proposals when the server's default is off.
    off = Speculator(SpeculativeConfig(method="off"))
    asks = running_request("e", [1, 2, 3, 1, 2], speculative="ngram")
    off.propose([asks, running_request("f", [1, 2, 3, 1, 2])])
    assert asks.draft_token_ids == [3, 1, 2]


def test_speculator_keeps_to_the_row_budget_and_stops_for_large_batches():
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=4, max_rows=7,
                               max_batch_sequences=3)
    spec = Speculator(config)
    a, b = running_request("a", [1, 2, 3, 4, 5, 6, 1, 2]), running_request("b", [1, 2, 3, 4, 5, 6, 1, 2])
    spec.propose([a, b])  # 7 rows: 2 for the decode tokens, 4 proposals, 1 left
    assert a.draft_token_ids == [3, 4, 5, 6] and b.draft_token_ids == [3]
    c = running_request("c", [1, 2, 1, 2])
    spec.propose([a, b, c])
    assert a.draft_token_ids == b.draft_token_ids == c.draft_token_ids == []


def test_adaptive_k_follows_acceptance():
    spec = Speculator(SpeculativeConfig(method="ngram", num_speculative_tokens=4))
    request = running_request("a", list(range(10)) * 3)
    spec.propose([request])
    assert len(request.draft_token_ids) == 4
    spec.record("a", 4, 1)  # the second proposal missed: next time two
    assert spec.states["a"].k == 2
    spec.record("a", 2, 2)
    assert spec.states["a"].k == 3
    spec.record("a", 3, 0)
    assert spec.states["a"].k == 1
    for _ in range(10):
        spec.record("a", 1, 1)
    assert spec.states["a"].k == 4
    spec.forget("a")
    assert "a" not in spec.states


def test_stats_count_like_vllm():
    stats = SpeculationStats()
    stats.record(4, 2)
    stats.record(2, 2)
    stats.record(0, 0)  # no proposal: not a draft
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (2, 6, 4)
    assert stats.accepted_per_position == [2, 2, 0, 0]
    assert stats.acceptance_rate == pytest.approx(4 / 6)
    assert stats.mean_accepted_length == pytest.approx(3.0)
    assert SpeculationStats().acceptance_rate is None


def test_config_and_params_refuse_bad_values():
    with pytest.raises(ValueError, match="speculative method"):
        SpeculativeConfig(method="eagle")
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SpeculativeConfig(num_speculative_tokens=0)
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        SpeculativeConfig(prompt_lookup_min=5, prompt_lookup_max=3)
    with pytest.raises(SamplingParamsError) as err:
        SamplingParams(speculative="maybe")
    assert err.value.param == "speculative"


# -- verification ----------------------------------------------------------------------------
def test_verification_keeps_samples_up_to_the_first_mismatch():
    drafts = {"a": (7, 8, 9), "b": (4,)}
    ids = ["a", "a", "a", "a", "p", "b", "b"]
    tokens = [7, 8, 5, 9, 3, 4, 6]  # a: 7=7, 8=8, 5!=9 -> kept 7 8 5; b: 4=4 -> 4 and 6
    kept = accepted_tokens(ids, tokens, [None] * len(ids), drafts)
    assert {rid: [s.token_id for s in v] for rid, v in kept.items()} == {
        "a": [7, 8, 5], "p": [3], "b": [4, 6]}
    # All accepted: the bonus token too.
    kept = accepted_tokens(["a"] * 4, [7, 8, 9, 1], [None] * 4, drafts)
    assert [s.token_id for s in kept["a"]] == [7, 8, 9, 1]
    # The first sample differs: one token, as a plain step.
    kept = accepted_tokens(["a"] * 4, [2, 8, 9, 1], [None] * 4, drafts)
    assert [s.token_id for s in kept["a"]] == [2]


def test_verification_rows_see_the_proposals_before_them():
    row = SamplingRow(SamplingParams(presence_penalty=1.0), [1, 2], [3])
    rows = verification_rows(["a", "a", "a", "p"], {"a": row, "p": row}, {"a": (7, 8)}, 100)
    assert [r.output_token_ids for r in rows] == [[3], [3, 7], [3, 7, 8], [3]]
    assert rows[0] is row and row.output_token_ids == [3]  # the request's own list untouched


# -- the scheduler with proposals -------------------------------------------------------------
def spec_step(sched, spec, accept, token=5):
    """One engine step with a fake runner: a verifying request keeps `accept(request, k)` of
    its k proposals (plus one token); stops as the engine checks them, token by token."""
    spec.propose(sched.running)
    out = sched.schedule()
    sampled = {}
    for item in out.scheduled:
        if not item.samples:
            continue
        proposals = list(item.token_ids[1:]) if item.num_draft_tokens else []
        kept = proposals[:accept(sched.requests[item.request_id], len(proposals))]
        sampled[item.request_id] = [SampledToken(t) for t in kept + [token]]
    for request, tokens, proposed in sched.update_from_output(out, RunnerOutput(sampled)):
        spec.record(request.request_id, proposed, len(tokens) - 1)
        for sampled_token in tokens:
            sched.append_token(request, sampled_token)
            reason = token_stop_reason(request)
            if reason is not None:
                sched.finish_request(request.request_id, reason)
                spec.forget(request.request_id)
                break
    return out


def quoting_req(rid, max_tokens=20):
    # A prompt that repeats: its n-grams always find a continuation.
    return Request(rid, [11, 12, 13, 14] * 3, SamplingParams(max_tokens=max_tokens),
                   eos_token_ids=(EOS,), max_model_len=10_000)


def test_proposals_ride_with_the_decode_token_and_rejected_blocks_go_back():
    sched = make(num_blocks=64, block_size=4, budget=64)
    spec = Speculator(SpeculativeConfig(method="ngram", num_speculative_tokens=5))
    request = quoting_req("a")
    sched.add_request(request)
    spec_step(sched, spec, accept=lambda r, k: k, token=11)  # prefill: 12 tokens, 3 blocks
    out = spec_step(sched, spec, accept=lambda r, k: 1, token=11)
    (item,) = out.scheduled
    # "12 13 14 11" occurred before: what followed it, up to the end of the request.
    assert item.token_ids == (11, 12, 13, 14, 11) and item.num_draft_tokens == 4
    assert item.block_table == (0, 1, 2, 3, 4)  # 17 slots: a fifth block for the proposals
    # 1 of 4 kept: the last token and one proposal computed, 2 tokens appended.
    assert request.num_computed_tokens == 14 and request.num_tokens == 15
    assert len(sched.kv.req_blocks["a"]) == 4  # the rejected ones' fifth block given back
    check_invariants(sched)
    assert sched.kv.num_free_blocks == 60


def test_proposals_are_dropped_before_anyone_is_preempted():
    sched = make(num_blocks=5, block_size=4, budget=64)
    spec = Speculator(SpeculativeConfig(method="ngram", num_speculative_tokens=5))
    sched.add_request(quoting_req("a"))
    sched.add_request(Request("b", [1, 2, 3], SamplingParams(max_tokens=20), max_model_len=10_000))
    spec_step(sched, spec, accept=lambda r, k: k, token=11)  # a: 3 blocks, b: 1 block
    out = spec_step(sched, spec, accept=lambda r, k: k, token=11)
    # a's 5 proposals would need 2 more blocks, only 1 is free: a decodes plainly instead.
    assert not out.preempted
    assert [(s.request_id, s.num_draft_tokens) for s in out.scheduled] == [("a", 0), ("b", 0)]


def test_budget_limits_the_proposals():
    """Proposals take what the step's token budget leaves after the decode token, no more."""
    sched = make(num_blocks=64, block_size=4, budget=3)
    spec = Speculator(SpeculativeConfig(method="ngram", num_speculative_tokens=5))
    request = Request("a", [7, 8, 9, 7, 8], SamplingParams(max_tokens=20), max_model_len=10_000)
    sched.add_request(request)
    spec_step(sched, spec, accept=lambda r, k: k, token=9)  # 3 of 5 prompt tokens
    spec_step(sched, spec, accept=lambda r, k: k, token=9)  # the other 2, then 9
    spec.propose(sched.running)
    assert request.draft_token_ids == [7, 8, 9]  # what followed "8 9" before
    (item,) = sched.schedule().scheduled
    assert item.num_draft_tokens == 2 and item.token_ids == (9, 7, 8)


def test_a_stop_inside_the_kept_tokens_ends_the_request_there():
    sched = make(num_blocks=64, block_size=4, budget=64)
    spec = Speculator(SpeculativeConfig(method="ngram", num_speculative_tokens=5))
    request = Request("a", [11, 12, EOS, 14, 11], SamplingParams(max_tokens=20),
                      eos_token_ids=(EOS,), max_model_len=10_000)
    sched.add_request(request)
    spec_step(sched, spec, accept=lambda r, k: k, token=12)  # "... 11 12": proposes EOS 14 11 12
    out = spec_step(sched, spec, accept=lambda r, k: k, token=7)
    assert out.scheduled[0].num_draft_tokens == 4
    assert request.is_finished and request.output_token_ids == [12, EOS]
    assert sched.kv.num_free_blocks == sched.kv.num_blocks
    # Length: proposals never run past max_tokens (a step yields at most k + 1 tokens).
    sched.add_request(request := quoting_req("b", max_tokens=3))
    spec_step(sched, spec, accept=lambda r, k: k, token=11)
    out = spec_step(sched, spec, accept=lambda r, k: k, token=11)
    assert out.scheduled[0].num_draft_tokens == 1
    assert request.is_finished and request.num_output_tokens == 3


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(6, 24), st.integers(1, 6))
def test_blocks_stay_exact_under_speculation_preemption_and_aborts(seed, num_blocks, k_max):
    """Random acceptance, a pool small enough to preempt, aborts: after every step each table
    holds exactly the blocks of its computed tokens, ref counts add up, and at the end every
    block is free."""
    rng = random.Random(seed)
    sched = make(num_blocks=num_blocks, block_size=4, budget=rng.choice([8, 16, 64]), max_seqs=4)
    spec = Speculator(SpeculativeConfig(method="ngram", num_speculative_tokens=k_max))
    for i in range(6):
        sched.add_request(Request(f"r{i}", [11, 12, 13] * rng.randint(1, 3),
                                  SamplingParams(max_tokens=rng.randint(1, 12)),
                                  eos_token_ids=(EOS,), max_model_len=10_000))
    proposed = 0
    for _ in range(200):
        if not sched.has_unfinished_requests():
            break
        out = spec_step(sched, spec, accept=lambda r, k: rng.randint(0, k),
                        token=rng.choice([11, 12, 13]))
        proposed += sum(s.num_draft_tokens for s in out.scheduled)
        check_invariants(sched)
        if rng.random() < 0.05 and sched.requests:
            victim = rng.choice(list(sched.requests))
            sched.finish_request(victim, FinishReason.ABORT)
            spec.forget(victim)
            check_invariants(sched)
    assert not sched.has_unfinished_requests()
    assert sched.kv.num_free_blocks == sched.kv.num_blocks
    assert all(b.ref_cnt == 0 for b in sched.kv.pool.blocks)

