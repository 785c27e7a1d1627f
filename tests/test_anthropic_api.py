"""Anthropic's Messages API through the official `anthropic` client against the real server:
answers whole and streamed, tools round trip, prefill, stop sequences, count_tokens, errors
in Anthropic's shape."""
import json

import anthropic
import httpx
import pytest

MODEL = "smollm2"
WEATHER = {"name": "get_weather", "description": "The weather in a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                            "required": ["city"]}}


@pytest.fixture()
def claude(server):
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0,
                               timeout=600)


GREEDY = {"extra_body": {"temperature": 0}}  # the newest SDK leaves sampling fields out


def test_message_whole_and_streamed_agree(claude):
    kwargs = dict(model=MODEL, max_tokens=12, system="You are a helpful assistant.", **GREEDY,
                  messages=[{"role": "user", "content": "What is the capital of France?"}])
    whole = claude.messages.create(**kwargs)
    assert whole.type == "message" and whole.role == "assistant" and whole.model == MODEL
    assert whole.content[0].type == "text" and "Paris" in whole.content[0].text
    assert whole.stop_reason in ("end_turn", "max_tokens")
    assert whole.usage.input_tokens > 0 and 0 < whole.usage.output_tokens <= 12
    with claude.messages.stream(**kwargs) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text == final.content[0].text
    assert final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_stream_events_come_in_anthropics_order(server):
    with httpx.stream("POST", server.url + "/v1/messages", timeout=600, json={
            "model": MODEL, "max_tokens": 5, "stream": True,
            "messages": [{"role": "user", "content": "Hi"}]}) as r:
        names = [line[len("event: "):] for line in r.iter_lines() if line.startswith("event: ")]
    assert names[:2] == ["message_start", "ping"]
    assert names[-2:] == ["message_delta", "message_stop"]
    body = names[2:-2]
    assert body[0] == "content_block_start" and body[-1] == "content_block_stop"
    assert set(body[1:-1]) == {"content_block_delta"}


def test_max_tokens_and_stop_sequences_say_why_they_stopped(claude):
    # (greedy: a sampled answer may end within 3 tokens, and say end_turn)
    long = claude.messages.create(model=MODEL, max_tokens=3, **GREEDY,
                                  messages=[{"role": "user", "content": "Count to fifty."}])
    assert long.stop_reason == "max_tokens" and long.usage.output_tokens == 3
    stopped = claude.messages.create(
        model=MODEL, max_tokens=40, stop_sequences=["3"], **GREEDY,
        messages=[{"role": "user", "content": "Count from 1 to 10, separated by commas."}])
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == "3"
    assert "3" not in stopped.content[0].text


def test_prefill_continues_the_assistant_turn(claude):
    out = claude.messages.create(model=MODEL, max_tokens=4, **GREEDY, messages=[
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "The capital of France is"}])
    assert "Paris" in out.content[0].text


def test_tools_round_trip(claude):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    called = claude.messages.create(model=MODEL, max_tokens=60, tools=[WEATHER], **GREEDY,
                                    tool_choice={"type": "tool", "name": "get_weather",
                                                 "disable_parallel_tool_use": True},
                                    messages=messages)
    assert called.stop_reason == "tool_use"
    use = [b for b in called.content if b.type == "tool_use"]
    assert len(use) >= 1 and use[0].name == "get_weather" and isinstance(use[0].input["city"], str)
    # The same call streamed: one tool_use block whose input arrives as JSON.
    with claude.messages.stream(model=MODEL, max_tokens=60, tools=[WEATHER], **GREEDY,
                                tool_choice={"type": "any", "disable_parallel_tool_use": True},
                                messages=messages) as stream:
        streamed = stream.get_final_message()
    assert streamed.stop_reason == "tool_use"
    assert [b.input for b in streamed.content if b.type == "tool_use"][0] == use[0].input
    answer = claude.messages.create(model=MODEL, max_tokens=20, tools=[WEATHER], **GREEDY,
                                    messages=messages + [
        {"role": "assistant", "content": called.content},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use[0].id,
                                      "content": "Sunny, 24 degrees"}]}])
    prompt = lambda usage: usage.input_tokens + usage.cache_read_input_tokens  # noqa: E731
    assert answer.content and prompt(answer.usage) > prompt(called.usage)
    assert answer.usage.cache_read_input_tokens > 0  # the conversation's prefix was reused


def test_output_config_format_holds_the_answer_to_a_schema(claude):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
              "required": ["city"], "additionalProperties": False}
    out = claude.messages.create(model=MODEL, max_tokens=40, **GREEDY,
                                 output_config={"format": {"type": "json_schema",
                                                           "schema": schema}},
                                 messages=[{"role": "user", "content": "Name a city."}])
    assert set(json.loads(out.content[0].text)) == {"city"}


def test_count_tokens_matches_the_prompt_the_answer_used(claude):
    kwargs = dict(model=MODEL, system="Be brief.",
                  messages=[{"role": "user", "content": "Hello there"}])
    counted = claude.messages.count_tokens(**kwargs)
    used = claude.messages.create(max_tokens=1, **kwargs)
    assert counted.input_tokens == used.usage.input_tokens + used.usage.cache_read_input_tokens


def test_errors_come_in_anthropics_shape(server, claude):
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.create(model="not-served", max_tokens=1,
                               messages=[{"role": "user", "content": "hi"}])
    assert claude.messages.create(model="claude-sonnet-4-5", max_tokens=1,  # an alias
                                  messages=[{"role": "user", "content": "hi"}]).model
    for body, field in [
        ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
        ({"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}],
          "thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
        ({"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": "AA=="}}]}]}, "messages"),
        ({"model": MODEL, "max_tokens": 1, "top_a": 1,
          "messages": [{"role": "user", "content": "hi"}]}, "top_a"),
    ]:
        r = httpx.post(server.url + "/v1/messages", json=body, timeout=600)
        assert r.status_code == 400, r.text
        error = r.json()
        assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
        assert field in error["error"]["message"]


def test_extended_thinking_is_taken_as_claude_code_sends_it(server, claude):
    """thinking enabled, and an earlier turn's thinking blocks in the history: accepted; on
    a model whose template has no thinking switch (SmolLM2) the answer is what it would be
    without, and the history's thinking is not in the prompt."""
    question = [{"role": "user", "content": "Name a colour."}]
    plain = claude.messages.create(model=MODEL, max_tokens=24, messages=question, **GREEDY)
    thinking = claude.messages.create(model=MODEL, max_tokens=24, messages=question,
                                      thinking={"type": "enabled", "budget_tokens": 16},
                                      **GREEDY)
    assert thinking.content[0].text == plain.content[0].text
    assert thinking.id.startswith("msg_")  # Anthropic's spelling of a message id
    history = [question[0], {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "The user wants a colour.", "signature": "c2ln"},
        {"type": "redacted_thinking", "data": "b3BhcXVl"},
        {"type": "text", "text": "Blue."}]}, {"role": "user", "content": "Another?"}]
    without = [history[0], {"role": "assistant", "content": "Blue."}, history[2]]
    assert claude.messages.count_tokens(model=MODEL, messages=history).input_tokens == \
        claude.messages.count_tokens(model=MODEL, messages=without).input_tokens
    answer = claude.messages.create(model=MODEL, max_tokens=8, messages=history,
                                    thinking={"type": "enabled", "budget_tokens": 4})
    assert answer.usage.output_tokens >= 1
    for body, words in [
        ({"thinking": {"type": "enabled"}}, "thinking.budget_tokens: is required"),
        ({"thinking": {"type": "enabled", "budget_tokens": 8}}, "less than max_tokens (8)"),
        ({"messages": [{"role": "user", "content": [
            {"type": "thinking", "thinking": "x", "signature": "y"}]}]},
         "thinking blocks come from the assistant"),
    ]:
        r = httpx.post(server.url + "/v1/messages", timeout=600, json={
            "model": MODEL, "max_tokens": 8, "messages": question, **body})
        assert r.status_code == 400 and words in r.json()["error"]["message"], r.text


def test_a_template_with_a_thinking_switch_is_given_it():
    """Qwen3's templates read enable_thinking: set from the request's thinking."""
    from tokenizers import Tokenizer as HFTokenizer, models

    from pagedllm.server.anthropic_protocol import Thinking
    from pagedllm.tokenizer import Tokenizer

    template = ("{% for m in messages %}{{ m.content }}{% endfor %}"
                "{% if enable_thinking is defined and not enable_thinking %}<think></think>"
                "{% endif %}")
    tok = Tokenizer(HFTokenizer(models.BPE({"a": 0}, [])), bos_token_id=None, add_bos=False,
                    eos_token_ids=[0], chat_template=template)
    assert tok.has_thinking_switch
    off = Thinking(type="disabled").template_options(tok.has_thinking_switch)
    on = Thinking(type="enabled", budget_tokens=10).template_options(tok.has_thinking_switch)
    assert off == {"enable_thinking": False} and on == {"enable_thinking": True}
    messages = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(messages, **off) == "hi<think></think>"
    assert tok.apply_chat_template(messages, **on) == "hi"
    assert Thinking(type="enabled", budget_tokens=10).template_options(False) == {}


def test_requests_are_counted_per_api(server, claude):
    def count() -> float:
        for line in httpx.get(server.url + "/metrics").text.splitlines():
            if line.startswith("pagedllm:api_requests_total{") and 'api="anthropic.messages"' in line:
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    before = count()
    claude.messages.create(model=MODEL, max_tokens=1, messages=[{"role": "user", "content": "hi"}])
    assert count() == before + 1
