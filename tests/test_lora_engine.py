"""LoRA on the real model: adapters peft trained on the bundled model (conftest's
trained_loras) served by the engine, against transformers + peft on the same weights; two
adapters and the base in one batch; the prefix cache; slots; speculative decoding and
structured output with an adapter; an adapter unloaded while it runs."""
import pytest
import torch

from lora_adapters import PHRASES, QUESTION
from pagedllm.config import LoRAConfig
from pagedllm.core.request import SamplingParams
from pagedllm.engine.engine import LLMEngine
from pagedllm.lora import AdapterError
from pagedllm.structured.spec import choice_spec

pytestmark = pytest.mark.slow
MAX_TOKENS = 10


def engine(trained_loras, dtype="float32", **lora):
    _, paths, gguf = trained_loras
    adapters = (("zorblax", paths["zorblax"]), ("quibbit", paths["quibbit"]),
                ("zorblax-gguf", gguf))
    return LLMEngine(dtype=dtype, kv_cache_memory=128 << 20, max_model_len=512,
                     lora=LoRAConfig(adapters=adapters, **lora))


@pytest.fixture(scope="module")
def float_engine(trained_loras):
    return engine(trained_loras)


def run(eng, jobs):
    """jobs: (adapter or None, prompt, params extra) -> finished outputs, all added at once."""
    ids = [eng.add_request(None, prompt, SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                        lora=adapter, **extra)).request_id
           for adapter, prompt, extra in jobs]
    done = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
    return [done[rid] for rid in ids]


def peft_greedy(model, adapter, prompt_ids, max_tokens=MAX_TOKENS):
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        if adapter is None:
            with model.disable_adapter():
                out = model.generate(ids, max_new_tokens=max_tokens, do_sample=False)
        else:
            model.set_adapter(adapter)
            out = model.generate(ids, max_new_tokens=max_tokens, do_sample=False)
    return out[0, len(prompt_ids):].tolist()


def test_greedy_output_equals_transformers_and_peft(float_engine, trained_loras):
    model = trained_loras[0]
    prompt = float_engine.tokenizer.encode(QUESTION)
    outs = run(float_engine, [(a, prompt, {}) for a in ("zorblax", "quibbit", None)])
    for out, adapter in zip(outs, ("zorblax", "quibbit", None)):
        assert out.token_ids == peft_greedy(model, adapter, prompt), adapter
    assert PHRASES["zorblax"].strip() in outs[0].text
    assert PHRASES["quibbit"].strip() in outs[1].text
    assert "Zorblax" not in outs[2].text and "Quibbit" not in outs[2].text


def test_logprobs_are_within_the_bases_tolerance_of_peft(float_engine, trained_loras):
    model = trained_loras[0]
    prompt = float_engine.tokenizer.encode(QUESTION)
    out = run(float_engine, [("quibbit", prompt, {"logprobs": 1})])[0]
    model.set_adapter("quibbit")
    with torch.no_grad():
        logits = model(torch.tensor([prompt + out.token_ids])).logits[0].float()
    reference = torch.log_softmax(logits, -1)
    for i, lp in enumerate(out.logprobs):
        assert lp.logprob == pytest.approx(reference[len(prompt) - 1 + i, lp.token_id].item(),
                                           abs=2e-3)


def test_each_request_of_a_mixed_batch_gets_what_it_gets_alone(float_engine):
    prompts = [QUESTION, "Question: Who are you?\nAnswer:", QUESTION + " The",
               "Tell me a story about"]
    jobs = [(adapter, prompt, {}) for prompt in prompts
            for adapter in ("zorblax", None, "quibbit")]
    together = [out.token_ids for out in run(float_engine, jobs)]
    alone = [run(float_engine, [job])[0].token_ids for job in jobs]
    assert together == alone


def test_the_gguf_adapter_answers_as_its_peft_folder(float_engine):
    peft, gguf = run(float_engine, [("zorblax", QUESTION, {}), ("zorblax-gguf", QUESTION, {})])
    assert peft.token_ids == gguf.token_ids


def test_a_prefix_is_shared_within_an_adapter_never_across(float_engine):
    prompt = QUESTION * 6  # several full blocks
    first = run(float_engine, [("zorblax", prompt, {})])[0]
    again, other, base = run(float_engine, [("zorblax", prompt, {}), ("quibbit", prompt, {}),
                                            (None, prompt, {})])
    assert first.num_cached_tokens == 0
    assert again.num_cached_tokens > 0
    assert other.num_cached_tokens == 0 and base.num_cached_tokens == 0


def test_fewer_slots_than_adapters_still_serves_everyone(trained_loras):
    eng = engine(trained_loras, max_loras=1)
    jobs = [("zorblax", QUESTION, {}), ("quibbit", QUESTION, {}), (None, QUESTION, {}),
            ("zorblax", QUESTION, {})]
    outs = run(eng, jobs)
    assert "Zorblax" in outs[0].text and "Quibbit" in outs[1].text and "Zorblax" in outs[3].text
    assert eng.scheduler.lora_slots.num_loads >= 2
    assert eng.stats().lora_requests == {"zorblax": 2, "quibbit": 1}


def test_the_bfloat16_fast_path_serves_adapters_beside_the_base(trained_loras):
    eng = engine(trained_loras, dtype="bfloat16")
    model = eng.runner.model
    loop = model.decode_loop
    assert loop is not None and loop.lora is model.lora  # decode steps stay in the C++ loop
    loop.ops = counting = CountingLoop(loop.ops)
    jobs = [("zorblax", QUESTION, {}), (None, QUESTION, {}), ("quibbit", QUESTION, {})]
    zorblax, base, quibbit = run(eng, jobs)
    assert "Zorblax" in zorblax.text and "Quibbit" in quibbit.text
    assert "Zorblax" not in base.text
    assert counting.with_lora and all(counting.with_lora)  # every decode step, in the loop
    assert run(eng, [(None, QUESTION, {})])[0].token_ids == base.token_ids
    model.decode_loop = None  # the Python layers: the same kernels, the same tokens
    try:
        assert [o.token_ids for o in run(eng, jobs)] == [o.token_ids for o in (zorblax, base,
                                                                               quibbit)]
    finally:
        model.decode_loop = loop


class CountingLoop:
    """The kernels, counting the C++ decode loop's calls (True: with LoRA stacks)."""

    def __init__(self, ops):
        self.ops, self.with_lora = ops, []

    def __getattr__(self, name):
        return getattr(self.ops, name)

    def decode_layers(self, *args):
        self.with_lora.append(bool(args[-4]))
        return self.ops.decode_layers(*args)


def test_speculative_decoding_with_an_adapter_gives_the_same_tokens(float_engine):
    plain = run(float_engine, [("zorblax", QUESTION, {})])[0]
    ngram = run(float_engine, [("zorblax", QUESTION, {"speculative": "ngram"})])[0]
    assert ngram.token_ids == plain.token_ids


def test_structured_output_with_an_adapter_follows_its_grammar(float_engine):
    spec = choice_spec([" Zorblax", " Quibbit", " Neither"])
    prompt = float_engine.requests.make_request(None, QUESTION, SamplingParams(
        temperature=0, max_tokens=MAX_TOKENS, lora="quibbit", guided=spec))
    float_engine.add(prompt)
    done = None
    while float_engine.has_unfinished_requests():
        for out in float_engine.step():
            done = out if out.finished else done
    assert done.text == " Quibbit"  # the adapter's answer, within the grammar


def test_an_unknown_or_unloaded_adapter_is_refused_and_its_running_requests_finish(
        trained_loras):
    eng = engine(trained_loras)
    with pytest.raises(ValueError, match="no LoRA adapter named 'nope'"):
        eng.add_request(None, QUESTION, SamplingParams(lora="nope"))
    request = eng.add_request(None, QUESTION, SamplingParams(temperature=0,
                                                             max_tokens=MAX_TOKENS,
                                                             lora="zorblax"))
    eng.step()  # admitted: it holds its slot
    made = eng.make_request(None, QUESTION, SamplingParams(lora="zorblax"))
    eng.loras.unload("zorblax")
    with pytest.raises(AdapterError, match="not loaded"):
        eng.add(made)  # made before the unload, added after: refused, nothing added
    done = None
    while eng.has_unfinished_requests():
        for out in eng.step():
            done = out if out.finished else done
    assert done.request_id == request.request_id and "Zorblax" in done.text
    assert eng.scheduler.lora_slots.slot_of == {}  # freed once its request ended
    assert eng.loras.get("zorblax") is None


def test_a_bad_adapter_stops_the_engine_from_starting(trained_loras, tmp_path):
    with pytest.raises(AdapterError, match="rank 8, above this server's --max-lora-rank 4"):
        engine(trained_loras, max_lora_rank=4)
