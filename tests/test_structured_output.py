"""Structured output: grammar specs from the request fields, compiled with llguidance, enforced
by a token mask in the batched sampler; through the official openai client on the real model."""
import json
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import httpx
import jsonschema
import pytest

from pagedllm.structured.compiler import GrammarMatcher
import torch
from pydantic import BaseModel, Field

from pagedllm.core.request import SamplingParams
from pagedllm.structured.spec import (GrammarError, GrammarSpec, choice_spec, grammar_spec,
                                      json_schema_spec, spec_from_request)

# -- specs (plain data, no model) ------------------------------------------------------------


def test_specs_from_each_request_field():
    schema = {"type": "object", "properties": {"b": {"type": "string"}, "a": {"type": "integer"}}}
    spec = spec_from_request({"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    assert spec.kind == "json_schema" and list(json.loads(spec.source)["properties"]) == ["b", "a"]
    assert json.loads(spec_from_request({"type": "json_object"}).source) == {"type": "object"}
    assert spec_from_request({"type": "text"}) is None and spec_from_request() is None
    assert spec_from_request(guided_json=json.dumps(schema)).param == "guided_json"
    assert spec_from_request(guided_regex=r"\d+") == GrammarSpec("regex", r"\d+", "guided_regex")
    choice = spec_from_request(guided_choice=["yes", 'say "no"'])
    assert choice.kind == "lark" and choice.source == 'start: "yes" | "say \\"no\\""\n'
    assert grammar_spec('root ::= "a"').kind == "gbnf"
    assert grammar_spec('start: "a"').kind == "lark"


@pytest.mark.parametrize("fields, param, words", [
    ({"response_format": {"type": "xml"}}, "response_format", "unknown type"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema needs"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex", "only one"),
    ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
    ({"guided_json": [1, 2]}, "guided_json", "must be an object"),
    ({"guided_choice": []}, "guided_choice", "non-empty"),
    ({"guided_choice": ["a", ""]}, "guided_choice", "non-empty"),
    ({"guided_regex": ""}, "guided_regex", "empty"),
    ({"guided_grammar": "  "}, "guided_grammar", "empty"),
])
def test_bad_specs_name_their_field(fields, param, words):
    with pytest.raises(GrammarError) as info:
        spec_from_request(**fields)
    assert info.value.param == param and words in str(info.value)


def test_sampling_params_take_only_a_spec():
    with pytest.raises(ValueError):
        SamplingParams(guided={"type": "object"})


# -- masks (the real tokenizer, no model) ----------------------------------------------------


@pytest.fixture(scope="module")
def compiler():
    from pagedllm.structured.compiler import GrammarCompiler
    from pagedllm.tokenizer import Tokenizer
    from pagedllm.weights import default_model_path

    tokenizer = Tokenizer.from_model_path(default_model_path())
    return GrammarCompiler(tokenizer, tokenizer.vocab_size)


class FailedMatcher(GrammarMatcher):
    """A walk the library gave up on: its mask allows its EOS tokens only."""

    failed, _eos = True, (2, 31, 32)

    def __init__(self):
        pass


def test_masks_forbid_exactly_what_the_grammar_forbids_and_leave_free_rows_alone(compiler):
    from pagedllm.structured.compiler import fill_bitmasks
    from pagedllm.structured.mask import apply_grammar_masks

    vocab = compiler.lltokenizer.vocab_size
    matcher = compiler.matcher(GrammarSpec("regex", "(yes|no)", "guided_regex"))
    words = torch.zeros(1, (vocab + 31) // 32, dtype=torch.int32)
    fill_bitmasks([matcher], words.data_ptr(), words.shape[1] * 4)
    expected = [t for t in range(vocab) if (int(words[0, t // 32]) >> (t % 32)) & 1]
    assert 0 < len(expected) < 100  # "y", "ye", "yes", "n", "no" and the like

    logits = torch.randn(3, vocab)
    before = logits.clone()
    apply_grammar_masks(logits, [None, matcher, FailedMatcher()])
    assert torch.equal(logits[0], before[0])
    assert torch.isfinite(logits[1]).nonzero().flatten().tolist() == expected
    assert torch.equal(logits[1, expected], before[1, expected])
    assert torch.isfinite(logits[2]).nonzero().flatten().tolist() == [2, 31, 32]  # bit 31 too
    every = torch.randn(2, vocab)
    apply_grammar_masks(every, [matcher, matcher])  # all rows guided: filled in place
    assert torch.isfinite(every).sum(dim=1).tolist() == [len(expected)] * 2


def _mask_allows(matcher, vocab):
    from pagedllm.structured.mask import apply_grammar_masks

    logits = torch.zeros(1, vocab)
    apply_grammar_masks(logits, [matcher])
    return torch.isfinite(logits[0])


def test_allows_answers_what_the_mask_would_at_every_step(compiler):
    """The sampler's draw-first path asks allows(token) instead of computing the mask: the
    two must agree on every token, inside a bounded string, at its end, and once complete."""
    tokenizer = compiler._tokenizer
    vocab = compiler.lltokenizer.vocab_size
    schema = {"type": "object", "additionalProperties": False, "required": ["a"],
              "properties": {"a": {"type": "string", "maxLength": 3}}}
    matcher = compiler.matcher(json_schema_spec(schema, "guided_json"))
    text = tokenizer.encode('{"a": "xyz"}', add_special_tokens=False)
    generator = torch.Generator().manual_seed(0)
    for step, token in enumerate([*text, None]):
        allowed = _mask_allows(matcher, vocab)
        probe = torch.cat([allowed.nonzero().flatten(),
                           torch.randint(vocab, (300,), generator=generator)]).tolist()
        assert [matcher.allows(t) for t in probe] == [bool(allowed[t]) for t in probe], step
        if token is not None:
            assert matcher.allows(token)
            matcher.accept(token)
    assert allowed.nonzero().flatten().tolist() == list(matcher.eos_token_ids)  # complete


def _one_hot_logits(rows: int, vocab: int, weights: dict[int, float]) -> torch.Tensor:
    logits = torch.full((rows, vocab), float("-inf"))
    for token, weight in weights.items():
        logits[:, token] = torch.tensor(weight).log()
    return logits


@pytest.fixture
def yes_no(compiler):
    """A yes/no grammar, its allowed first tokens for "yes" and "no", and a refused one."""
    tokenizer = compiler._tokenizer
    matcher = compiler.matcher(GrammarSpec("regex", "(yes|no)", "guided_regex"))
    yes, no, hello = (tokenizer.encode(w, add_special_tokens=False)[0] for w in ("yes", "no", "hello"))
    assert matcher.allows(yes) and matcher.allows(no) and not matcher.allows(hello)
    return matcher, yes, no, hello


def test_a_draw_the_grammar_allows_costs_no_mask(compiler, yes_no, monkeypatch):
    import pagedllm.engine.sampler as sampler_module
    from pagedllm.engine.sampler import Sampler, SamplingRow

    matcher, yes, no, hello = yes_no
    masks = []
    real_apply = sampler_module.apply_grammar_masks
    monkeypatch.setattr(sampler_module, "apply_grammar_masks",
                        lambda logits, ms: masks.append(len(ms)) or real_apply(logits, ms))
    vocab = compiler.lltokenizer.vocab_size

    def sample(params, weights):
        masks.clear()
        row = SamplingRow(params, [1], [], grammar=matcher)
        return Sampler()(_one_hot_logits(1, vocab, weights), [row])[0][0]

    greedy = SamplingParams(temperature=0)
    assert sample(greedy, {yes: 0.7, no: 0.2, hello: 0.1}) == yes and masks == []
    # Refused: one mask, for that row, and the masked argmax.
    assert sample(greedy, {hello: 0.7, no: 0.2, yes: 0.1}) == no and masks == [1]
    # A truncating row is masked before its draw (top-p of the masked distribution).
    assert sample(SamplingParams(top_p=0.5), {hello: 0.7, no: 0.2, yes: 0.1}) == no and masks == [1]


def test_a_sync_free_draw_masks_every_grammar_row_first(compiler, yes_no, monkeypatch):
    """On a GPU (sync_free) asking the grammar about a drawn token would read the token
    back: every grammar row is masked first instead, allows() is never asked, and the token
    is the grammar's (greedy: the masked argmax, as drawing first gives)."""
    import pagedllm.engine.sampler as sampler_module
    from pagedllm.engine.sampler import Sampler, SamplingRow

    matcher, yes, no, hello = yes_no
    masks = []
    real_apply = sampler_module.apply_grammar_masks
    monkeypatch.setattr(sampler_module, "apply_grammar_masks",
                        lambda logits, ms: masks.append(len(ms)) or real_apply(logits, ms))
    monkeypatch.setattr(type(matcher), "allows", lambda self, token: pytest.fail("asked"))
    vocab = compiler.lltokenizer.vocab_size
    rows = [SamplingRow(SamplingParams(temperature=0), [1], [], grammar=matcher),
            SamplingRow(SamplingParams(temperature=1.0, seed=3), [1], [], grammar=matcher,
                        generator=torch.Generator().manual_seed(3)),
            SamplingRow(SamplingParams(temperature=0), [1], [])]
    logits = _one_hot_logits(3, vocab, {hello: 0.7, yes: 0.2, no: 0.1})
    tokens = Sampler(sync_free=True).draw(logits, rows).tolist()
    assert tokens[0] == yes and tokens[1] in (yes, no) and tokens[2] == hello
    assert masks == [3]  # one mask call, over the batch (the free row left alone)


def test_drawing_first_keeps_the_distribution_of_masked_sampling(compiler, yes_no):
    """p(hello) = 0.6 is refused; kept or redrawn, yes must come 0.3 / 0.4 of the time."""
    from pagedllm.engine.sampler import Sampler, SamplingRow

    matcher, yes, no, hello = yes_no
    vocab = compiler.lltokenizer.vocab_size
    torch.manual_seed(0)
    counts = {yes: 0, no: 0, hello: 0}
    draws, batch = 4000, 200
    for _ in range(draws // batch):
        rows = [SamplingRow(SamplingParams(temperature=1.0), [1], [], grammar=matcher)
                for _ in range(batch)]
        tokens, _ = Sampler()(_one_hot_logits(batch, vocab, {hello: 0.6, yes: 0.3, no: 0.1}), rows)
        for t in tokens:
            counts[t] += 1
    assert counts[hello] == 0
    assert abs(counts[yes] / draws - 0.75) < 0.03  # binomial sd ~0.007
    # Seeded rows stay reproducible on this path too (one draw, or two when refused).
    seeded = [SamplingRow(SamplingParams(temperature=1.0, seed=7), [1], [], grammar=matcher,
                          generator=torch.Generator().manual_seed(7)) for _ in range(2)]
    first = Sampler()(_one_hot_logits(1, vocab, {hello: 0.6, yes: 0.3, no: 0.1}), seeded[:1])[0]
    again = Sampler()(_one_hot_logits(1, vocab, {hello: 0.6, yes: 0.3, no: 0.1}), seeded[1:])[0]
    assert first == again


# -- the engine (real model, in process) -----------------------------------------------------

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "pets"],
          "properties": {"name": {"type": "string", "maxLength": 16},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "pets": {"type": "array", "minItems": 1, "maxItems": 3,
                                  "items": {"enum": ["cat", "dog", "fish"]}}}}


def _chat_ids(llm, text):
    tok = llm.tokenizer
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]),
                      add_special_tokens=False)


@pytest.mark.parametrize("spec, param", [
    (json_schema_spec({"type": "strnig"}, "guided_json"), "guided_json"),
    (json_schema_spec({"type": "integer", "minimum": 5, "maximum": 2}, "response_format"),
     "response_format"),
    (GrammarSpec("regex", "((", "guided_regex"), "guided_regex"),
    (grammar_spec("root ::= ("), "guided_grammar"),
    (grammar_spec("start: undefined_rule"), "guided_grammar"),
])
def test_grammars_that_cannot_compile_are_refused_before_queueing(real_llm, spec, param):
    engine = real_llm.engine
    with pytest.raises(GrammarError) as info:
        engine.make_request(None, "Hi", SamplingParams(guided=spec))
    assert info.value.param == param
    assert not engine.has_unfinished_requests()


def test_guided_and_free_requests_share_a_step_and_the_free_ones_are_unchanged(real_llm):
    ids = _chat_ids(real_llm, "Tell me about a person.")
    free = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    alone = real_llm.generate([ids, ids], free)
    guided = SamplingParams(max_tokens=80, temperature=1.0, seed=3,
                            guided=json_schema_spec(PERSON, "guided_json"))
    engine = real_llm.engine
    for i in range(2):
        engine.add_request(f"free{i}", ids, free)
        engine.add_request(f"json{i}", ids, guided)
    finished, batch_sizes = {}, []
    while engine.has_unfinished_requests():
        batch_sizes.append(engine.scheduler.num_running)
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert max(batch_sizes) == 4  # all four ran in the same steps
    assert [finished[f"free{i}"].token_ids for i in range(2)] == [o.token_ids for o in alone]
    for i in range(2):
        jsonschema.validate(json.loads(finished[f"json{i}"].text), PERSON)
    assert engine.runner.sequences == {}


def test_choice_regex_and_gbnf_are_followed(real_llm):
    ids = _chat_ids(real_llm, "Is the sky blue?")
    hot = dict(max_tokens=20, temperature=1.0)
    for seed in range(4):
        out = real_llm.generate([ids], SamplingParams(**hot, seed=seed,
                                                      guided=choice_spec(["yes", "no"])))[0]
        assert out.text in ("yes", "no") and out.finish_reason == "stop"
    out = real_llm.generate([ids], SamplingParams(**hot, guided=GrammarSpec(
        "regex", r"[0-9]{3}-[a-z]{2}", "guided_regex")))[0]
    assert len(out.text) == 6 and out.text[:3].isdigit() and out.text[3] == "-"
    out = real_llm.generate([ids], SamplingParams(**hot, guided=grammar_spec(
        'root ::= "answer: " ("yes" | "no")')))[0]
    assert out.text in ("answer: yes", "answer: no")


# -- the server, through the official client -------------------------------------------------


class Pet(BaseModel):
    kind: Literal["cat", "dog", "fish"]
    name: str = Field(max_length=12)


class Owner(BaseModel):
    name: str = Field(max_length=16)
    age: int
    pets: list[Pet] = Field(min_length=1, max_length=2)


TOPICS = ["a farmer", "a pilot", "a child", "a teacher", "a painter", "a sailor", "a baker",
          "a doctor", "a poet", "a miner", "a nurse", "a judge", "a chef", "a monk", "a clown",
          "a spy", "a knight", "a queen", "a runner", "a robot"]


def test_parse_with_a_pydantic_model_always_parses_at_temperature_1(client):
    def ask(topic):
        return client.chat.completions.parse(
            model="smollm2", messages=[{"role": "user", "content": f"Describe {topic} and pets."}],
            response_format=Owner, temperature=1.0, max_tokens=120)

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(ask, TOPICS))
    for answer in answers:
        message = answer.choices[0].message
        assert answer.choices[0].finish_reason == "stop", message.content
        assert isinstance(message.parsed, Owner)


SCHEMA = {"type": "object", "additionalProperties": False,
          "required": ["title", "rating", "author", "tags"],
          "properties": {
              "title": {"type": "string", "maxLength": 30},
              "rating": {"enum": [1, 2, 3, 4, 5]},
              "author": {"type": "object", "additionalProperties": False,
                         "required": ["first", "last"],
                         "properties": {"first": {"type": "string", "maxLength": 12},
                                        "last": {"type": "string", "maxLength": 12}}},
              "tags": {"type": "array", "minItems": 2, "maxItems": 3,
                       "items": {"type": "string", "maxLength": 10}}}}


def test_json_schema_answers_validate_on_both_endpoints_streamed_or_not(client):
    """All requests at once (the server batches them; each is checked on its own)."""
    fmt = {"type": "json_schema", "json_schema": {"name": "book", "schema": SCHEMA, "strict": True}}
    review = [{"role": "user", "content": "Review a book."}]

    def chat(seed):
        r = client.chat.completions.create(model="smollm2", messages=review, response_format=fmt,
                                           temperature=1.0, seed=seed, max_tokens=150)
        return r.choices[0].message.content

    def streamed(_):
        stream = client.chat.completions.create(model="smollm2", messages=review,
                                                response_format=fmt, temperature=1.0,
                                                max_tokens=150, stream=True)
        return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

    def completion(_):
        r = client.completions.create(model="smollm2", prompt="A book review as JSON:",
                                      max_tokens=150, temperature=1.0,
                                      extra_body={"guided_json": SCHEMA})
        return r.choices[0].text

    def json_object(seed):
        r = client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": "A tiny JSON object, please."}],
            response_format={"type": "json_object"}, max_tokens=200, temperature=1.0, seed=seed)
        return r.choices[0].message.content, r.choices[0].finish_reason

    with ThreadPoolExecutor(9) as pool:
        guided = [pool.submit(chat, seed) for seed in range(3)]
        guided += [pool.submit(streamed, None), pool.submit(completion, None)]
        objects = [pool.submit(json_object, seed) for seed in range(4)]
        for future in guided:
            jsonschema.validate(json.loads(future.result()), SCHEMA)
        # json_object bounds nothing (the small model can list numbers until max_tokens), so
        # every answer must be an object and every finished one must parse
        stopped = 0
        for future in objects:
            text, finish = future.result()
            assert text.startswith("{"), text
            if finish == "stop":
                stopped += 1
                assert isinstance(json.loads(text), dict)
    assert stopped


def test_guided_choice_over_http(client):
    for seed in range(3):
        r = client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": "Pick a colour."}],
            temperature=1.0, seed=seed, extra_body={"guided_choice": ["red", "green", "blue"]})
        assert r.choices[0].message.content in ("red", "green", "blue")


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                                                 "schema": {"type": "strnig"}}}},
     "response_format"),
    ({"guided_json": {"type": "integer", "minimum": 3, "maximum": 1}}, "guided_json"),
    ({"guided_regex": "(("}, "guided_regex"),
    ({"guided_grammar": "root ::= ("}, "guided_grammar"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_choice": "red"}, "guided_choice"),
    ({"response_format": "json"}, "response_format"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
])
def test_bad_grammars_get_a_400_naming_the_field_and_the_server_keeps_serving(server, body, param):
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "model": "smollm2", "messages": [{"role": "user", "content": "Hi"}], **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    ok = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "model": "smollm2", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
    assert ok.status_code == 200


def _grammar_takes(compiler, spec, text: str) -> bool:
    """Whether the grammar lets the model write `text` token by token."""
    matcher = compiler.matcher(spec)
    for token in compiler._tokenizer.encode(text, add_special_tokens=False):
        if not matcher.allows(token):
            return False
        matcher.accept(token)
    return True


def test_a_forced_calls_arguments_follow_required_and_additional_properties(compiler):
    """A forced tool call's grammar holds the arguments to the function's schema: a property
    the schema does not allow (additionalProperties: false) and a missing required one are
    refused, a valid call is taken."""
    from pagedllm.tool_calls.spec import ToolChoice, parse_tools
    from pagedllm.tool_calls.syntax import HERMES

    functions = parse_tools([{"type": "function", "function": {
        "name": "get_weather", "parameters": {
            "type": "object", "properties": {"city": {"type": "string"}},
            "required": ["city"], "additionalProperties": False}}}])
    spec = HERMES.grammar(functions, ToolChoice("named", "get_weather"), parallel=False)
    call = '<tool_call>\n{"name": "get_weather", "arguments": %s}\n</tool_call>'
    assert _grammar_takes(compiler, spec, call % '{"city": "Paris"}')
    assert not _grammar_takes(compiler, spec, call % '{"city": "Paris", "units": "C"}')
    assert not _grammar_takes(compiler, spec, call % '{}')


def test_masks_along_proposed_tokens_are_the_masks_after_consuming_them(compiler):
    """A request verifying proposals samples position j under the grammar's mask after the
    first j of them (GrammarMatcher.masks_along); the walk stays where it was; a proposal
    the grammar refuses ends the masks there."""
    from pagedllm.tokenizer import Tokenizer
    from pagedllm.weights import default_model_path

    vocab = compiler.lltokenizer.vocab_size
    tokenizer = Tokenizer.from_model_path(default_model_path())
    spec = GrammarSpec("regex", "(one two three|one four)", "guided_regex")
    tokens = tokenizer.encode("one two three", add_special_tokens=False)
    assert len(tokens) >= 3
    matcher = compiler.matcher(spec)
    masks = matcher.masks_along(tokens, (vocab + 31) // 32 * 4)
    assert len(masks) == len(tokens)  # after each of them
    step_by_step = compiler.matcher(spec)
    for j, mask in enumerate(masks):
        step_by_step.accept(tokens[j])
        want = _mask_allows(step_by_step, vocab)
        assert torch.equal(_mask_allows(mask, vocab), want), j
        assert [t for t in range(vocab) if mask.allows(t)] == want.nonzero().flatten().tolist()
    assert torch.equal(_mask_allows(matcher, vocab), _mask_allows(compiler.matcher(spec), vocab))
    refused = tokenizer.encode(" zebra", add_special_tokens=False)
    assert len(matcher.masks_along(tokens[:1] + refused, (vocab + 31) // 32 * 4)) == 1
