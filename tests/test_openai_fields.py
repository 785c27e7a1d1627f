"""OpenAI-style requests: logit_bias, assistant prefill, llama.cpp's structured-output names,
fields refused rather than ignored, routes without /v1 and model aliases, through the
official openai client and raw HTTP against the real server."""
import json

import httpx
import openai
import pytest

MODEL = "smollm2"
PROMPT = "The capital of France is"


def post(server, path, body):
    return httpx.post(server.url + path, json=body, timeout=600)


def first_token_id(server, prompt: str, text: str) -> int:
    """The id of the token a greedy answer `text` starts with, from the server's tokenizer."""
    base = post(server, "/tokenize", {"prompt": prompt}).json()["tokens"]
    longer = post(server, "/tokenize", {"prompt": prompt + text}).json()["tokens"]
    assert longer[:len(base)] == base
    return longer[len(base)]


def test_logit_bias_bans_and_forces_tokens(server, client):
    greedy = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0)
    token = first_token_id(server, PROMPT, greedy.choices[0].text)
    banned = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0,
                                       logit_bias={str(token): -100})
    assert banned.choices[0].text != greedy.choices[0].text
    # Forced: a token the model would never pick here, three times running, on chat too.
    forced_id = first_token_id(server, "", " banana")
    forced = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hi"}], max_tokens=3,
        temperature=0.7, seed=3, logit_bias={str(forced_id): 100})
    assert forced.choices[0].message.content.count("banana") == 3


@pytest.mark.parametrize("bias, why", [
    ({"5": 101}, "less than or equal to 100"),
    ({"abc": 1}, "keys are token ids"),
    ({"99999999": 1}, "token ids must be in"),
    ({str(i): 1 for i in range(301)}, "at most 300"),
])
def test_bad_logit_bias_is_a_400_naming_it(server, bias, why):
    r = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 1, "logit_bias": bias})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"].startswith("logit_bias") and why in error["message"]


@pytest.mark.parametrize("path, field, value", [
    ("/v1/completions", "best_of", 2),
    ("/v1/completions", "suffix", "!"),
    ("/v1/chat/completions", "mirostat", 2),
    ("/v1/chat/completions", "functions", [{"name": "f"}]),
])
def test_a_field_the_server_does_not_honour_is_refused_by_name(server, path, field, value):
    body = {"max_tokens": 1, field: value}
    body.update({"prompt": "hi"} if "chat" not in path else
                {"messages": [{"role": "user", "content": "hi"}]})
    r = post(server, path, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == field and error["code"] == "unsupported_field"


def test_fields_without_effect_on_the_answer_are_accepted(client):
    out = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
        metadata={"team": "search"}, store=False, service_tier="auto",
        extra_body={"cache_prompt": True})
    assert out.choices[0].message.content is not None


SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
          "required": ["city"], "additionalProperties": False}


@pytest.mark.parametrize("extra", [
    {"json_schema": SCHEMA},  # llama.cpp's top-level field
    {"response_format": {"type": "json_object", "schema": SCHEMA}},  # llama.cpp's form
])
def test_llama_cpp_structured_output_fields_are_honoured(server, extra):
    r = post(server, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Name a city."}], "max_tokens": 40,
        "temperature": 0, **extra})
    assert r.status_code == 200, r.text
    answer = json.loads(r.json()["choices"][0]["message"]["content"])
    assert set(answer) == {"city"} and isinstance(answer["city"], str)


def test_llama_cpp_grammar_field_is_honoured(server):
    r = post(server, "/v1/completions", {"prompt": "Answer yes or no:", "max_tokens": 5,
                                         "grammar": 'root ::= "yes" | "no"'})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] in ("yes", "no")


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_object", "schemaa": SCHEMA}}, "response_format.schemaa"),
    ({"response_format": {"type": "text", "schema": SCHEMA}}, "response_format.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA,
                                                                 "extra": 1}}},
     "response_format.json_schema.extra"),
    ({"grammar": 'root ::= "a"', "guided_regex": "b"}, "grammar"),
    ({"continue_final_message": True, "add_generation_prompt": True}, "continue_final_message"),
])
def test_contradictory_or_unknown_structure_fields_are_refused(server, body, param):
    r = post(server, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "A"}],
        "max_tokens": 2, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_continue_final_message_continues_the_assistant_text(client):
    messages = [{"role": "user", "content": "What is the capital of France?"},
                {"role": "assistant", "content": "The capital of France is"}]
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4,
                                         temperature=0,
                                         extra_body={"continue_final_message": True,
                                                     "add_generation_prompt": False})
    assert "Paris" in out.choices[0].message.content
    # Without the flag, a final assistant turn is closed and a new one begins.
    fresh = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4,
                                           temperature=0)
    assert fresh.choices[0].message.content != out.choices[0].message.content


def test_continuing_needs_a_final_assistant_message(server):
    r = post(server, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
        "continue_final_message": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


def test_routes_answer_without_v1(server):
    bare = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=600)
    assert [m.id for m in bare.models.list().data] == [MODEL]
    out = bare.chat.completions.create(model=MODEL, max_tokens=2,
                                       messages=[{"role": "user", "content": "hi"}])
    assert out.choices[0].message.content is not None
    assert bare.completions.create(model=MODEL, prompt="hi", max_tokens=2).choices[0].text


def test_an_alias_answers_and_other_names_stay_404(server, client):
    out = client.chat.completions.create(model="gpt-4o-mini", max_tokens=2,
                                         messages=[{"role": "user", "content": "hi"}])
    assert out.model == MODEL  # the answer names what served it
    assert client.completions.create(model="claude-3-haiku", prompt="hi", max_tokens=1)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4o", prompt="hi", max_tokens=1)
