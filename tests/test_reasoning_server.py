"""A reasoning model's thinking kept apart on every API, through the official clients: the
default model served with a Qwen3-style chat template (`--chat-template`: the generation
prompt opens `<think>`, `enable_thinking: false` closes an empty block) and a thinking
budget, so that the budget writes `</think>` into the answer and the model goes on to answer.
OpenAI's reasoning_content (streamed and whole alike, counted in usage), Anthropic's thinking
blocks, Ollama's `thinking`, the Responses API's reasoning items; structured output applies
to the answer after the thinking; bad settings are refused by name."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import httpx
import pytest

from server_process import ServerProcess, free_port

TEMPLATE = os.path.join(os.path.dirname(__file__), "templates", "think_chatml.jinja")
BUDGET = 12
STORY = [{"role": "user", "content": "Tell me a long story about a dragon."}]


@pytest.fixture(scope="module")
def thinking_server(tmp_path_factory):
    log = tmp_path_factory.mktemp("reasoning") / "server.log"
    proc = ServerProcess("--dtype", "float32", "--kv-cache-memory", str(64 << 20),
                         "--served-model-name", "smollm2", "--chat-template", TEMPLATE,
                         "--reasoning-budget", str(BUDGET), log_path=str(log))
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def end_marker_tokens():
    from pagedllm.tokenizer import Tokenizer
    from pagedllm.weights import default_model_path

    return len(Tokenizer.from_model_path(default_model_path()).encode(
        "</think>", add_special_tokens=False))


def _openai(server):
    from openai import OpenAI

    return OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_the_ready_line_says_the_parser_auto_chose(thinking_server):
    assert ("reasoning parser: qwen3 (auto: from the chat template): thinking between <think> "
            "and </think>" in thinking_server.output())
    # the template renders no tools: they go into the system prompt in Hermes' syntax
    assert "tool-call parser: hermes (auto: the chat template renders no tools" in \
        thinking_server.output()


def test_openai_chat_returns_the_thinking_apart_and_counts_it(thinking_server,
                                                               end_marker_tokens):
    answer = _openai(thinking_server).chat.completions.create(
        model="smollm2", messages=STORY, max_tokens=60, temperature=0)
    message = answer.choices[0].message
    thinking = message.model_extra["reasoning_content"]
    assert thinking and message.content
    assert "think>" not in thinking and "think>" not in message.content
    details = answer.usage.completion_tokens_details
    assert details.reasoning_tokens == BUDGET + end_marker_tokens  # the budget, then the marker

    stream = _openai(thinking_server).chat.completions.create(
        model="smollm2", messages=STORY, max_tokens=60, temperature=0, stream=True,
        stream_options={"include_usage": True})
    streamed_thinking, streamed_content, usage = "", "", None
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            streamed_thinking += (choice.delta.model_extra or {}).get("reasoning_content") or ""
            streamed_content += choice.delta.content or ""
    assert (streamed_thinking, streamed_content) == (thinking, message.content)
    assert usage.completion_tokens_details.reasoning_tokens == details.reasoning_tokens


def test_thinking_turned_off_by_the_template_switch(thinking_server):
    answer = _openai(thinking_server).chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "What is 2+2?"}], max_tokens=20,
        temperature=0, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    message = answer.choices[0].message
    assert message.content and message.model_extra["reasoning_content"] is None
    assert answer.usage.completion_tokens_details.reasoning_tokens == 0


def test_an_unknown_template_variable_is_refused_by_name(thinking_server):
    r = httpx.post(thinking_server.url + "/v1/chat/completions", json={
        "model": "smollm2", "messages": STORY, "max_tokens": 2,
        "chat_template_kwargs": {"enable_thinkin": False}})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "chat_template_kwargs.enable_thinkin"
    assert "reads: enable_thinking" in error["message"]


def test_structured_output_applies_to_the_answer_after_the_thinking(thinking_server):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}},
              "required": ["name"], "additionalProperties": False}
    answer = _openai(thinking_server).chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Name a dragon, as JSON."}],
        max_tokens=80, temperature=0, response_format={
            "type": "json_schema", "json_schema": {"name": "dragon", "schema": schema}})
    message = answer.choices[0].message
    assert message.model_extra["reasoning_content"]  # the thinking ran free of the schema
    assert set(json.loads(message.content)) == {"name"}


def test_anthropic_thinking_blocks_with_their_budget(thinking_server):
    from anthropic import Anthropic

    client = Anthropic(base_url=thinking_server.url, api_key="unused", max_retries=0)
    ask = dict(model="smollm2", max_tokens=60, messages=STORY, extra_body={"temperature": 0},
               thinking={"type": "enabled", "budget_tokens": 6})
    message = client.messages.create(**ask)
    thinking, text = message.content[0], message.content[1]
    assert thinking.type == "thinking" and thinking.thinking and thinking.signature
    assert text.type == "text" and text.text and "think>" not in text.text
    with client.messages.stream(**ask) as stream:
        streamed = stream.get_final_message()
    assert [b.type for b in streamed.content] == ["thinking", "text"]
    assert streamed.content[0].thinking == thinking.thinking
    assert streamed.content[1].text == text.text


def test_ollama_thinking_comes_back_as_its_own_field(thinking_server):
    import ollama

    client = ollama.Client(host=thinking_server.url)
    on = client.chat(model="smollm2", messages=STORY, think=True,
                     options={"num_predict": 60, "temperature": 0})
    assert on.message.thinking and on.message.content
    assert "think>" not in on.message.content
    pieces = list(client.chat(model="smollm2", messages=STORY, think=True, stream=True,
                              options={"num_predict": 60, "temperature": 0}))
    assert "".join(p.message.thinking or "" for p in pieces) == on.message.thinking
    assert "".join(p.message.content or "" for p in pieces) == on.message.content
    off = client.chat(model="smollm2", messages=[{"role": "user", "content": "What is 2+2?"}],
                      think=False, options={"num_predict": 20, "temperature": 0})
    assert not off.message.thinking and off.message.content


def test_responses_api_reasoning_items(thinking_server):
    client = _openai(thinking_server)
    response = client.responses.create(model="smollm2", input=STORY[0]["content"],
                                       max_output_tokens=60, temperature=0)
    kinds = [item.type for item in response.output]
    assert kinds == ["reasoning", "message"]
    assert response.output[0].content[0].text and response.output_text
    assert response.usage.output_tokens_details.reasoning_tokens > BUDGET
    events = list(client.responses.create(model="smollm2", input=STORY[0]["content"],
                                          max_output_tokens=60, temperature=0, stream=True))
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert deltas == response.output[0].content[0].text
    final = next(e for e in events if e.type in ("response.completed",
                                                 "response.incomplete")).response
    assert [item.type for item in final.output] == kinds
    effort_off = client.responses.create(model="smollm2", input="What is 2+2?", temperature=0,
                                         max_output_tokens=20, reasoning={"effort": "none"})
    assert [item.type for item in effort_off.output] == ["message"]


@pytest.mark.parametrize("args, message", [
    (["--chat-template", "no such file and no template"], "not a Jinja template"),
    (["--chat-template", "{% if %}"], "does not parse"),
    (["--reasoning-parser", "r1"], "invalid choice: 'r1'"),
    (["--reasoning-budget", "0"], "--reasoning-budget"),
    (["--tool-call-parser", "mistal"], "invalid choice: 'mistal'"),
])
def test_bad_reasoning_settings_are_refused_at_start(args, message):
    done = subprocess.run([sys.executable, "-m", "pagedllm.cli", "serve", "--port", str(free_port()), *args],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert message in done.stderr


def test_apply_template_shows_the_prompt_and_earlier_thinking_reaches_the_template(
        thinking_server):
    url = thinking_server.url
    asked = {"messages": [{"role": "user", "content": "hi"}]}
    opened = httpx.post(url + "/apply-template", json=asked).json()["prompt"]
    assert opened.endswith("<|im_start|>assistant\n<think>\n")
    closed = httpx.post(url + "/apply-template", json={
        **asked, "chat_template_kwargs": {"enable_thinking": False}}).json()["prompt"]
    assert closed.endswith("<think>\n\n</think>\n\n")
    history = [{"role": "user", "content": "hi"},
               {"role": "assistant", "content": "Hello!", "reasoning_content": "Be kind."},
               {"role": "user", "content": "and?"}]
    prompt = httpx.post(url + "/apply-template", json={"messages": history}).json()["prompt"]
    assert "<think>\nBe kind.\n</think>\n\nHello!" in prompt
    # Anthropic's thinking blocks are the same history: count_tokens sees them
    from anthropic import Anthropic

    client = Anthropic(base_url=url, api_key="unused", max_retries=0)
    turns = [{"role": "user", "content": "hi"},
             {"role": "assistant", "content": [
                 {"type": "thinking", "thinking": "Be kind.", "signature": "x"},
                 {"type": "text", "text": "Hello!"}]},
             {"role": "user", "content": "and?"}]
    plain = [turns[0], {"role": "assistant", "content": "Hello!"}, turns[2]]
    with_thinking = client.messages.count_tokens(model="smollm2", messages=turns)
    without = client.messages.count_tokens(model="smollm2", messages=plain)
    assert with_thinking.input_tokens > without.input_tokens


@pytest.mark.parametrize("content, message", [
    (b"{{ 'x' }}" * 200_000, "a chat template is at most"),
    (b"\xff\xfe{{ x }}", "not UTF-8 text"),
])
def test_a_chat_template_file_too_large_or_not_text_is_refused(tmp_path, content, message):
    path = tmp_path / "template.jinja"
    path.write_bytes(content)
    done = subprocess.run([sys.executable, "-m", "pagedllm.cli", "serve", "--port",
                           str(free_port()), "--chat-template", str(path)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert message in done.stderr
