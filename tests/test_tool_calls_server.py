"""Tool calls over HTTP on the real default model, through the official openai client:
forced choices always give calls whose arguments validate, streamed calls reassemble to the
non-streamed ones, "auto" reads the model's own syntax back into tool_calls, a conversation
with earlier calls and results renders, and bad tools get a 400 naming the field."""
import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import pytest

WEATHER_PARAMS = {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                  "properties": {"city": {"type": "string", "maxLength": 20},
                                 "unit": {"enum": ["celsius", "fahrenheit"]},
                                 "days": {"type": "integer", "minimum": 1, "maximum": 7}}}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                      "parameters": WEATHER_PARAMS}},
    {"type": "function", "function": {"name": "get_time", "description": "Time in a zone",
                                      "parameters": {"type": "object", "required": ["zone"],
                                                     "additionalProperties": False,
                                                     "properties": {"zone": {"type": "string",
                                                                             "maxLength": 20}}}}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris, and what time is it there?"}]


def _check_calls(calls):
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_required_always_gives_calls_whose_arguments_validate(client):
    """One call (parallel_tool_calls off) always completes. With parallel calls the grammar
    lets the model go on calling, and at temperature 1 it sometimes does until max_tokens
    cuts it: the calls it finished still validate."""
    def ask(seed_and_parallel):
        seed, parallel = seed_and_parallel
        return parallel, client.chat.completions.create(
            model="smollm2", messages=ASK, tools=TOOLS, tool_choice="required",
            temperature=1.0, seed=seed, max_tokens=200, parallel_tool_calls=parallel)

    cases = [(seed, parallel) for seed in range(3) for parallel in (False, True)]
    with ThreadPoolExecutor(len(cases)) as pool:  # one batch on the server
        answers = list(pool.map(ask, cases))
    for parallel, r in answers:
        choice = r.choices[0]
        if parallel and choice.finish_reason == "length":
            _check_calls(choice.message.tool_calls)
            continue
        assert choice.finish_reason == "tool_calls", choice.message
        assert choice.message.content is None
        _check_calls(choice.message.tool_calls)
        assert parallel or len(choice.message.tool_calls) == 1


def test_a_named_function_and_no_parallel_calls_give_exactly_that_one_call(client):
    def ask(seed):
        return client.chat.completions.create(
            model="smollm2", messages=ASK, tools=TOOLS, temperature=1.0, seed=seed,
            tool_choice={"type": "function", "function": {"name": "get_time"}},
            parallel_tool_calls=False, max_tokens=120)

    with ThreadPoolExecutor(3) as pool:
        answers = list(pool.map(ask, range(3)))
    for r in answers:
        calls = r.choices[0].message.tool_calls
        assert len(calls) == 1 and calls[0].function.name == "get_time"
        _check_calls(calls)


def _streamed_calls(stream):
    calls, content, finish = {}, "", None
    for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            finish = choice.finish_reason or finish
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = delta.id or call["id"]
                call["name"] += delta.function.name or ""
                call["arguments"] += delta.function.arguments or ""
    return content, [calls[i] for i in sorted(calls)], finish


def test_streamed_calls_reassemble_to_the_same_calls(client):
    args = dict(model="smollm2", messages=ASK, tools=TOOLS, tool_choice="required",
                temperature=0.0, max_tokens=200)
    whole = client.chat.completions.create(**args).choices[0].message.tool_calls
    content, streamed, finish = _streamed_calls(client.chat.completions.create(**args, stream=True))
    assert finish == "tool_calls" and content == ""
    assert [(c["name"], c["arguments"]) for c in streamed] == [
        (c.function.name, c.function.arguments) for c in whole]
    assert all(c["id"].startswith("call_") for c in streamed)


# The model's own text forced into the Hermes syntax by a grammar, so "auto" has something
# to read: a sentence, then a call.
AUTO_TEXT = ('Checking. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", '
             '"unit": "celsius"}}\n</tool_call>')


def test_auto_reads_the_models_calls_out_of_its_text_streamed_or_not(client):
    extra = {"guided_grammar": f"start: {json.dumps(AUTO_TEXT)}"}  # Lark: one literal
    args = dict(model="smollm2", messages=ASK, tools=TOOLS, max_tokens=80, extra_body=extra)
    message = client.chat.completions.create(**args).choices[0].message
    assert message.content == "Checking."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [
        ("get_weather", {"city": "Oslo", "unit": "celsius"})]
    content, calls, finish = _streamed_calls(client.chat.completions.create(**args, stream=True))
    assert content == "Checking." and finish == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Oslo", "unit": "celsius"})]
    # the same text with tool_choice "none" (or no tools) stays text
    plain = client.chat.completions.create(**{**args, "tool_choice": "none"}).choices[0]
    assert plain.message.content == AUTO_TEXT and not plain.message.tool_calls
    assert plain.finish_reason == "stop"


def test_a_conversation_with_calls_and_results_renders_and_answers(client):
    messages = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'}]
    r = client.chat.completions.create(model="smollm2", messages=messages, tools=TOOLS,
                                       temperature=0.0, max_tokens=16)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert r.usage.prompt_tokens > 200  # the tools' descriptions are in the prompt
    bare = client.chat.completions.create(model="smollm2", messages=ASK, max_tokens=1)
    assert bare.usage.prompt_tokens < 60


BAD_TOOL = {"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"a": {"type": "strnig"}}}}}


@pytest.mark.parametrize("fields, param", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name"),
    ({"tools": [TOOLS[0], BAD_TOOL]}, "tools[1].function.parameters"),
    ({"tools": "get_weather"}, "tools"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {
        "name": "get_weather", "arguments": "{not json"}}]}]},
     "messages[0].tool_calls[0].function.arguments"),
])
def test_bad_tools_get_a_400_naming_the_field_and_the_server_keeps_serving(server, fields, param):
    body = {"model": "smollm2", "messages": ASK, "max_tokens": 4, **fields}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    ok = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "model": "smollm2", "messages": ASK, "max_tokens": 2, "tools": TOOLS})
    assert ok.status_code == 200
