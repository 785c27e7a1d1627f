"""Every family's tool calls through a real server and the official clients: a tiny random
model whose vocabulary has the families' markers as special tokens, served with each
family's chat template (`--chat-template`). A forced tool_choice makes the model write a call
in its family's syntax (the grammar names the special tokens); the answer's text keeps those
markers, so the family's parser reads the call back: OpenAI tool_calls (whole and as stream
deltas), Anthropic tool_use blocks, Ollama's tool_calls. A Magistral-style template's
thinking markers ([THINK], [/THINK], special tokens) split the thinking from the answer under
a budget."""
import json
from contextlib import contextmanager

import pytest

from family_templates import FAMILY_SPECIAL_TOKENS, MAGISTRAL, TOOL_TEMPLATES

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "required": ["city", "unit"], "additionalProperties": False,
                   "properties": {"city": {"enum": ["Paris", "Oslo"]},
                                  "unit": {"enum": ["c", "f"]}}}}}
ASK = [{"role": "system", "content": "You help."}, {"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def family_client(tmp_path_factory):
    from tiny_models import tiny_hf_model, write_hf_folder
    from pagedllm import LLM
    from pagedllm.serving.local import LocalEngineClient

    folder = tmp_path_factory.mktemp("family-model")
    write_hf_folder(tiny_hf_model(vocab_size=288, max_position_embeddings=2048), folder,
                    FAMILY_SPECIAL_TOKENS)
    client = LocalEngineClient(LLM(str(folder), dtype="float32", kv_cache_memory=16 << 20).engine,
                               start_thread=True)
    yield client
    client.shutdown()


@contextmanager
def _served(family_client, template, reasoning_parser="none", **config):
    """An app with this template over the module's engine; its lifespan is not entered (its
    end would shut the shared engine down). reasoning_parser: none, as the vocabulary holds
    [THINK] for the thinking test (auto would read every family's model as Magistral's)."""
    from fastapi.testclient import TestClient

    from pagedllm.server.app import create_app
    from pagedllm.server.server_config import ServerConfig

    config = ServerConfig(chat_template=template, reasoning_parser=reasoning_parser, **config)
    http = TestClient(create_app(family_client, "tiny", config))
    try:
        yield http
    finally:
        http.close()


def _openai(http):
    from openai import OpenAI

    return OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http,
                  max_retries=0)


@pytest.mark.parametrize("family", sorted(TOOL_TEMPLATES))
def test_a_forced_call_in_each_familys_syntax_comes_back_as_tool_calls(family, family_client):
    with _served(family_client, TOOL_TEMPLATES[family]) as http:
        prompt = http.post("/apply-template", json={"messages": ASK, "tools": [WEATHER]}).json()
        assert "get_weather" in prompt["prompt"]  # the family's template rendered the tools
        openai = _openai(http)
        answer = openai.chat.completions.create(
            model="tiny", messages=ASK, tools=[WEATHER], max_tokens=200, temperature=0,
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            parallel_tool_calls=False)
        choice = answer.choices[0]
        assert choice.finish_reason == "tool_calls", choice.message
        assert choice.message.content is None
        (call,) = choice.message.tool_calls
        arguments = json.loads(call.function.arguments)
        assert call.function.name == "get_weather" and set(arguments) == {"city", "unit"}

        stream = openai.chat.completions.create(
            model="tiny", messages=ASK, tools=[WEATHER], max_tokens=200, temperature=0,
            tool_choice="required", parallel_tool_calls=False, stream=True)
        names, streamed, finish = [], "", None
        for chunk in stream:
            for delta_call in chunk.choices[0].delta.tool_calls or []:
                names.append(delta_call.function.name)
                streamed += delta_call.function.arguments or ""
            finish = chunk.choices[0].finish_reason or finish
        assert finish == "tool_calls" and names == ["get_weather"]
        assert json.loads(streamed) == arguments

        # the call and its result go back through the family's template: it renders them
        history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                   {"role": "tool", "tool_call_id": call.id, "content": "21 C"}]
        rendered = http.post("/apply-template", json={"messages": history, "tools": [WEATHER]})
        assert rendered.status_code == 200 and "21 C" in rendered.json()["prompt"]


@pytest.mark.parametrize("family", ["mistral_v11", "deepseek_v3"])
def test_anthropic_and_ollama_get_the_familys_calls_in_their_shapes(family, family_client):
    import anthropic

    with _served(family_client, TOOL_TEMPLATES[family]) as http:
        client = anthropic.Anthropic(base_url="http://testserver", api_key="unused",
                                     http_client=http, max_retries=0)
        message = client.messages.create(
            model="tiny", max_tokens=200, messages=ASK[1:], system=ASK[0]["content"],
            tools=[{"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}],
            tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
            extra_body={"temperature": 0})
        assert message.stop_reason == "tool_use"
        (block,) = [b for b in message.content if b.type == "tool_use"]
        assert block.name == "get_weather" and set(block.input) == {"city", "unit"}

        # Ollama's API (its own client speaks another httpx than the in-process app's): no
        # tool_choice there, so the random model's free answer is text or calls; either way
        # the family's markers never show as text, and a call comes in Ollama's shape
        answer = http.post("/api/chat", json={
            "model": "tiny", "messages": ASK, "tools": [WEATHER], "stream": False,
            "options": {"temperature": 0, "num_predict": 60}}).json()["message"]
        for marker in ("[TOOL_CALLS]", "[ARGS]", "<｜tool▁calls▁begin｜>", "<｜tool▁sep｜>"):
            assert marker not in answer["content"]
        for call in answer.get("tool_calls") or []:
            assert isinstance(call["function"]["arguments"], dict)


def test_thinking_marked_by_special_tokens_is_split_under_a_budget(family_client):
    """[THINK] opens the thinking in the prompt; the budget writes [/THINK] (one special
    token) into the answer; both are kept in the text for the splitter, and neither shows."""
    with _served(family_client, MAGISTRAL, "auto", reasoning_budget=6) as http:
        tok = family_client.tokenizer
        # the random model favours [THINK] and may end at once: neither, here
        banned = {tok.special_token_ids({"[THINK]"})["[THINK]"]: -100, tok.eos_token_ids[0]: -100}
        answer = _openai(http).chat.completions.create(
            model="tiny", messages=ASK, max_tokens=30, temperature=0, logit_bias=banned)
        message = answer.choices[0].message
        thinking = message.model_extra["reasoning_content"]
        # 6 thinking tokens and the end marker; then the answer (without [/THINK] kept in
        # the text, the whole answer would have read as thinking)
        assert answer.usage.completion_tokens_details.reasoning_tokens == 7
        assert thinking and message.content
        for text in (thinking, message.content or ""):
            assert "[THINK]" not in text and "[/THINK]" not in text


def test_a_forced_call_after_special_token_thinking(family_client):
    """Magistral's shape: the thinking ([THINK] opened by the prompt) ends by the budget's
    [/THINK]; the forced call's grammar applies after it, in Mistral v11's syntax; the
    thinking comes back apart and the call as tool_calls."""
    with _served(family_client, MAGISTRAL, "auto", reasoning_budget=4) as http:
        answer = _openai(http).chat.completions.create(
            model="tiny", messages=ASK, tools=[WEATHER], max_tokens=200, temperature=0,
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            parallel_tool_calls=False)
        choice = answer.choices[0]
        assert choice.finish_reason == "tool_calls", choice.message
        assert choice.message.model_extra["reasoning_content"]
        assert answer.usage.completion_tokens_details.reasoning_tokens == 5
        (call,) = choice.message.tool_calls
        assert set(json.loads(call.function.arguments)) == {"city", "unit"}
