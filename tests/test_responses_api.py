"""OpenAI's Responses API through the official client's `client.responses` against the real
server: text and items in, whole and streamed answers, previous_response_id, tools, a JSON
schema, errors; and the bounded store behind previous_response_id (pure Python)."""
import json

import httpx
import openai
import pytest

from pagedllm.server.response_store import ResponseStore

MODEL = "smollm2"
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"]}}


def test_text_in_text_out_whole_and_streamed(client):
    kwargs = dict(model=MODEL, input="What is the capital of France?", max_output_tokens=12,
                  temperature=0)
    whole = client.responses.create(**kwargs)
    assert whole.object == "response" and whole.status in ("completed", "incomplete")
    # OpenAI's spelling of the ids (clients and tools check the prefixes).
    assert whole.id.startswith("resp_") and whole.output[0].id.startswith("msg_")
    assert "Paris" in whole.output_text
    assert whole.usage.output_tokens <= 12 and whole.usage.input_tokens > 0
    events = list(client.responses.create(stream=True, **kwargs))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert streamed == whole.output_text == events[-1].response.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_instructions_are_the_system_prompt(client):
    plain = client.responses.create(model=MODEL, input="Hi", max_output_tokens=1)
    told = client.responses.create(model=MODEL, input="Hi", max_output_tokens=1,
                                   instructions="You are a careful assistant for a team of engineers. Answer "
                                                "in French, in one short sentence, and never "
                                                "use lists, tables or code unless asked.")
    assert told.usage.input_tokens > plain.usage.input_tokens and told.instructions


def test_a_missing_model_is_the_one_served_as_on_the_chat_route(server):
    answer = httpx.post(server.url + "/v1/responses", timeout=120,
                        json={"input": "Hi", "max_output_tokens": 2})
    assert answer.status_code == 200 and answer.json()["model"] == "smollm2"


def test_max_output_tokens_makes_it_incomplete(client):
    out = client.responses.create(model=MODEL, input="Count to fifty.", max_output_tokens=3)
    assert out.status == "incomplete" and out.incomplete_details.reason == "max_output_tokens"


def test_previous_response_id_continues_the_conversation(server, client):
    first = client.responses.create(model=MODEL, input="My name is Ada. Say hello.",
                                    max_output_tokens=8, temperature=0)
    second = client.responses.create(model=MODEL, input="What is my name?",
                                     previous_response_id=first.id, max_output_tokens=8,
                                     temperature=0)
    # The earlier turns are in the prompt: it is longer than both new inputs alone.
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert client.responses.retrieve(first.id).id == first.id
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=MODEL, input="Again?", previous_response_id=first.id,
                                max_output_tokens=2)
    unstored = client.responses.create(model=MODEL, input="hi", store=False, max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_function_call_round_trip(client):
    called = client.responses.create(model=MODEL, input="What is the weather in Paris?",
                                     tools=[WEATHER], tool_choice="required",
                                     parallel_tool_calls=False, max_output_tokens=60, temperature=0)
    calls = [item for item in called.output if item.type == "function_call"]
    assert calls and calls[0].name == "get_weather"
    assert isinstance(json.loads(calls[0].arguments)["city"], str)
    streamed = list(client.responses.create(model=MODEL, input="What is the weather in Paris?",
                                            tools=[WEATHER], tool_choice="required",
                                            parallel_tool_calls=False, max_output_tokens=60, temperature=0, stream=True))
    done = [e for e in streamed if e.type == "response.function_call_arguments.done"]
    assert done and done[0].arguments == calls[0].arguments
    answer = client.responses.create(
        model=MODEL, tools=[WEATHER], max_output_tokens=20, temperature=0,
        input=[{"role": "user", "content": "What is the weather in Paris?"},
               {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather",
                "arguments": calls[0].arguments},
               {"type": "function_call_output", "call_id": calls[0].call_id,
                "output": "Sunny, 24 degrees"}])
    assert answer.status in ("completed", "incomplete") and answer.output


def test_text_format_json_schema_is_followed(client):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
              "required": ["city"], "additionalProperties": False}
    out = client.responses.create(model=MODEL, input="Name a city.", max_output_tokens=40,
                                  temperature=0, text={"format": {
                                      "type": "json_schema", "name": "city", "schema": schema}})
    assert set(json.loads(out.output_text)) == {"city"}


@pytest.mark.parametrize("body, field", [
    ({"input": "hi", "reasoning": {"effort": "high"}}, "reasoning.effort"),  # no thinking
    ({"input": "hi", "reasoning": {"summary": "auto"}}, "reasoning.summary"),
    ({"input": "hi", "background": True}, "background"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools"),
    ({"input": "hi", "previous_response_id": "resp_nope"}, "previous_response_id"),
])
def test_what_is_not_honoured_is_refused(server, body, field):
    r = httpx.post(server.url + "/v1/responses", json={"model": MODEL, **body}, timeout=600)
    assert r.status_code in (400, 404), r.text
    error = r.json()["error"]
    assert (error["param"] or "").startswith(field) or field in error["message"]


def test_store_is_bounded_by_count_bytes_and_time():
    now = [0.0]
    store = ResponseStore(ttl=10, max_responses=3, max_bytes=100, clock=lambda: now[0])
    turn = lambda text: [{"role": "user", "content": text}]  # noqa: E731
    for i in range(5):
        store.put(f"r{i}", "alice", turn("x" * 10), {"id": f"r{i}"})
    assert len(store) == 3 and store.get("r0", "alice") is None  # oldest went first
    assert store.get("r4", "bob") is None  # nobody reads another's response
    store.put("big", "alice", turn("x" * 90), {})
    assert store.bytes <= 100 and store.get("big", "alice") is not None
    store.put("huge", "alice", turn("x" * 101), {})  # larger than the store: not kept
    assert store.get("huge", "alice") is None
    now[0] = 11.0
    assert store.get("big", "alice") is None and len(store) == 0 and store.bytes == 0
