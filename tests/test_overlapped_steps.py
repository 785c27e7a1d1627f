"""Overlapped steps on the real default model (CPU): step t+1 planned and launched before
step t's tokens are applied must give exactly the tokens, logprobs and finish reasons of
steps run one at a time, through greedy and seeded sampling, penalties, stops, aborts,
preemption, speculation (which turns the overlap off while it runs) and structured output,
and free every KV block."""
import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.engine.faults import Faults
from pagedllm.structured.spec import choice_spec
from pagedllm.tools.text_prompts import make_prompt_token_ids

LENGTHS = [30, 600, 75, 250, 140, 410, 45, 330]
SETTINGS = dict(dtype="float32", max_model_len=1024, max_num_seqs=8)


@pytest.fixture(scope="module")
def engines():
    """The same engine twice: steps one at a time, and overlapped."""
    return {overlap: LLM(**SETTINGS, overlap_steps=overlap).engine for overlap in (False, True)}


def run(engine, requests, abort_at: dict[str, int] | None = None):
    """requests: (id, prompt, params); abort_at: request id -> the step it is aborted after.
    Returns each request's final output."""
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    finished, steps = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        steps += 1
        for rid, step in (abort_at or {}).items():
            if step == steps and rid not in finished:
                finished[rid] = engine.abort_request(rid)
    assert engine.kv_manager.num_free_blocks == engine.cache_config.num_blocks
    # Nor a row of the runner's block tables kept across steps (engine/block_table_rows.py).
    assert len(engine.runner.table_rows) == 0
    return finished


def summary(outputs):
    return {rid: (out.token_ids, out.finish_reason, out.text,
                  [(lp.token_id, round(lp.logprob, 4)) for lp in out.logprobs or []])
            for rid, out in outputs.items()}


def mixed_requests(tokenizer):
    prompts = make_prompt_token_ids(tokenizer, LENGTHS, seed=1)
    params = [
        SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=2),
        SamplingParams(max_tokens=20, temperature=0.9, seed=11, top_p=0.9),
        SamplingParams(max_tokens=18, temperature=0.7, seed=12, presence_penalty=1.0,
                       repetition_penalty=1.3),
        SamplingParams(max_tokens=1, temperature=0.0),  # its one token is its pending one
        SamplingParams(max_tokens=30, temperature=0.0, stop=[" the", "."]),
        SamplingParams(max_tokens=30, temperature=1.2, seed=13, top_k=40, frequency_penalty=0.5),
        SamplingParams(max_tokens=16, temperature=0.0, stop_token_ids=[11, 13, 28]),
        SamplingParams(max_tokens=25, temperature=0.8, seed=14, min_p=0.05, logprobs=1),
    ]
    return [(f"r{i}", p, q) for i, (p, q) in enumerate(zip(prompts, params))]


def test_overlapped_steps_give_the_tokens_of_steps_run_one_at_a_time(engines):
    requests = mixed_requests(engines[False].tokenizer)
    expected = summary(run(engines[False], requests))
    got = summary(run(engines[True], requests))
    assert got == expected
    assert {out[1] for out in got.values()} >= {"length", "stop"}


def test_an_abort_while_a_step_is_in_flight_frees_its_blocks_and_spares_the_rest(engines):
    requests = mixed_requests(engines[False].tokenizer)
    abort_at = {"r0": 4, "r1": 3, "r7": 1}  # (r0 ignores EOS: it cannot finish by then)
    expected = summary(run(engines[False], requests, abort_at))
    got = summary(run(engines[True], requests, abort_at))
    assert got["r0"][1] == "abort" and len(got) == len(requests)
    # The requests not aborted get the same outputs; an aborted one ends with what it had
    # by then (which overlapped steps know a step later), unless it had finished before.
    for rid in expected:
        if rid not in abort_at:
            assert got[rid] == expected[rid]
        elif got[rid][1] == "abort":
            assert got[rid][0] == expected[rid][0][:len(got[rid][0])]
        else:
            assert got[rid] == expected[rid]


def test_preemption_while_steps_overlap_keeps_every_output():
    # 26 blocks of 16: the 300-token request alone grows to 21, so others are preempted.
    small = {overlap: LLM(dtype="float32", kv_cache_memory=26 * 16 * 46080, max_model_len=400,
                          max_num_seqs=8, overlap_steps=overlap).engine for overlap in (False, True)}
    prompts = make_prompt_token_ids(small[False].tokenizer, [n // 2 for n in LENGTHS], seed=1)
    requests = [(f"r{i}", p, SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
                 if i % 2 else SamplingParams(max_tokens=24, temperature=0.8, seed=i))
                for i, p in enumerate(prompts)]
    expected = summary(run(small[False], requests))
    got = summary(run(small[True], requests))
    assert small[True].stats().num_preemptions > 0
    assert got == expected


def test_a_speculating_request_turns_the_overlap_off_while_it_runs(engines):
    engine = engines[True]
    prompt = make_prompt_token_ids(engine.tokenizer, [200], seed=3)[0]
    plain = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    speculating = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True,
                                 speculative="ngram")
    expected = summary(run(engines[False], [("a", prompt, plain), ("b", prompt, plain)]))
    engine.add_request("a", prompt, plain)
    engine.step()
    engine.step()
    assert engine.overlap.applies(engine.scheduler) and engine._launched is not None
    engine.add_request("b", prompt, speculating)
    assert not engine.overlap.applies(engine.scheduler)
    got = summary(run(engine, []))
    assert got["b"] == expected["b"]
    assert got["a"][0] == expected["a"][0]  # (its first outputs came before run() above)
    assert engine.overlap.applies(engine.scheduler)  # back on once nobody speculates


def test_structured_output_under_overlapped_steps(engines):
    prompt = make_prompt_token_ids(engines[False].tokenizer, [60], seed=4)[0]
    guided = SamplingParams(max_tokens=12, temperature=0.8, seed=5,
                            guided=choice_spec(["yes", "no", "maybe later"], "guided_choice"))
    requests = [("g", prompt, guided),
                ("p", prompt, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))]
    expected = summary(run(engines[False], requests))
    got = summary(run(engines[True], requests))
    assert got == expected
    assert got["g"][2] in {"yes", "no", "maybe later"}


def test_a_request_whose_sampling_fails_fails_alone_under_overlapped_steps():
    engine = LLM(**SETTINGS, overlap_steps=True, faults=Faults(fail_sampling_seed=99)).engine
    prompts = make_prompt_token_ids(engine.tokenizer, [40, 50], seed=5)
    got = run(engine, [("bad", prompts[0], SamplingParams(max_tokens=8, temperature=0.5, seed=99)),
                       ("good", prompts[1], SamplingParams(max_tokens=8, temperature=0.0,
                                                           ignore_eos=True))])
    assert got["bad"].finish_reason == "error" and "injected sampling fault" in got["bad"].error
    assert got["good"].finish_reason == "length" and len(got["good"].token_ids) == 8


def test_steps_overlap_by_default_on_a_gpu_only_and_the_command_line_says_otherwise():
    from pagedllm.cli import build_parser, engine_config
    from pagedllm.config import EngineConfig

    assert EngineConfig().overlaps_steps("cuda") and not EngineConfig().overlaps_steps("cpu")
    assert EngineConfig(overlap_steps=True).overlaps_steps("cpu")
    assert not EngineConfig(overlap_steps=False).overlaps_steps("cuda")
    parse = lambda *flags: engine_config(build_parser().parse_args(["serve", *flags]))  # noqa: E731
    assert parse().overlap_steps is None
    assert parse("--overlap-steps").overlap_steps is True
    assert parse("--async-scheduling").overlap_steps is True  # vLLM's name
    assert parse("--no-overlap-steps").overlap_steps is False


def test_a_fault_outside_any_request_drops_the_launched_step_and_the_engine_goes_on(engines):
    """A step that fails outside any one request (here the scheduler, while a step is in
    flight) raises to the caller with the launched step dropped; the caller fails its
    requests (AsyncEngine aborts them), every block comes back, and the next request gets
    the tokens a fresh run gives it."""
    engine = LLM(**SETTINGS, overlap_steps=True).engine
    prompts = make_prompt_token_ids(engine.tokenizer, [40, 60, 30], seed=7)
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    for i in (0, 1):
        engine.add_request(f"r{i}", prompts[i], greedy)
    for _ in range(3):
        engine.step()
    assert engine._launched is not None  # a step is in flight

    def broken(ahead=False):
        raise RuntimeError("scheduler fault")

    engine.scheduler.schedule = broken
    with pytest.raises(RuntimeError, match="scheduler fault"):
        engine.step()
    del engine.scheduler.schedule  # the class's own again
    assert engine._launched is None
    for rid in engine.request_ids():
        assert engine.abort_request(rid).finish_reason == "abort"
    assert not engine.has_unfinished_requests()
    assert engine.kv_manager.num_free_blocks == engine.cache_config.num_blocks
    after = run(engine, [("next", prompts[2], greedy)])
    fresh = run(engines[False], [("next", prompts[2], greedy)])
    assert summary(after) == summary(fresh)
