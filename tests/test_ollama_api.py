"""Ollama's API on the real server, through the official `ollama` client: chat and generate,
streamed and not, format as a schema, tools, the model listing routes; the same request
through both APIs gives the same text; bad input gets Ollama's {"error": ...} and the right
status, and the server keeps serving."""
import json

import httpx
import jsonschema
import ollama
import pytest

GREEDY = {"temperature": 0, "num_predict": 12}
HI = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture()
def oclient(server):
    return ollama.Client(host=server.url, timeout=120)


def test_chat_streamed_and_not_gives_the_same_text_and_ollamas_fields(oclient):
    whole = oclient.chat(model="smollm2", messages=HI, options=GREEDY)
    assert whole.done and whole.done_reason == "length" and whole.message.role == "assistant"
    assert whole.eval_count == 12 and whole.prompt_eval_count > 5
    assert whole.total_duration >= whole.eval_duration > 0 and whole.load_duration == 0
    chunks = list(oclient.chat(model="smollm2", messages=HI, options=GREEDY, stream=True))
    assert all(not c.done for c in chunks[:-1]) and chunks[-1].done
    assert chunks[-1].eval_count == 12 and chunks[-1].message.content == ""
    assert "".join(c.message.content for c in chunks) == whole.message.content
    assert oclient.chat(model="smollm2:latest", messages=HI, options=GREEDY).message.content == \
        whole.message.content  # the ":latest" tag names the same model


def test_the_same_request_through_both_apis_gives_the_same_text(oclient, client):
    ours = oclient.chat(model="smollm2", messages=HI, options={**GREEDY, "seed": 7})
    openai = client.chat.completions.create(model="smollm2", messages=HI, temperature=0,
                                            seed=7, max_tokens=12)
    assert ours.message.content == openai.choices[0].message.content
    text = oclient.generate(model="smollm2", prompt="Name three colours.", options=GREEDY)
    assert text.response == ours.message.content  # generate renders the chat template too


def test_generate_raw_streamed_and_context_continues(oclient, client, server):
    raw = oclient.generate(model="smollm2", prompt="The capital of France is", raw=True,
                           options=GREEDY)
    completion = client.completions.create(model="smollm2", prompt="The capital of France is",
                                           temperature=0, max_tokens=12)
    assert raw.response == completion.choices[0].text
    pieces = list(oclient.generate(model="smollm2", prompt="The capital of France is",
                                   raw=True, options=GREEDY, stream=True))
    assert "".join(p.response for p in pieces) == raw.response and pieces[-1].done
    assert len(raw.context) == raw.prompt_eval_count + raw.eval_count
    more = oclient.generate(model="smollm2", prompt=" And", raw=True, context=raw.context,
                            options={**GREEDY, "num_predict": 4})
    assert more.prompt_eval_count == len(raw.context) + len(
        httpx.post(server.url + "/tokenize",
                   json={"prompt": " And", "add_special_tokens": False}).json()["tokens"])


PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 16},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120}}}


def test_format_a_schema_or_json_is_followed(oclient):
    for seed in range(3):
        r = oclient.chat(model="smollm2", messages=[{"role": "user", "content": "A person?"}],
                         format=PERSON, options={"temperature": 1, "seed": seed,
                                                 "num_predict": 80})
        jsonschema.validate(json.loads(r.message.content), PERSON)
    r = oclient.generate(model="smollm2", prompt="A JSON object with a number, please.",
                         format="json", options={"temperature": 0, "num_predict": 60})
    assert r.response.startswith("{")


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "required": ["city"],
                   "properties": {"city": {"type": "string"}}}}}


def test_tools_on_chat_put_the_tools_in_the_prompt_and_history_renders(oclient):
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    plain = oclient.chat(model="smollm2", messages=ask, options={**GREEDY, "num_predict": 1})
    offered = oclient.chat(model="smollm2", messages=ask, tools=[WEATHER],
                           options={**GREEDY, "num_predict": 1})
    assert offered.prompt_eval_count > plain.prompt_eval_count + 50
    history = ask + [
        {"role": "assistant", "content": "",
         "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": '{"temperature": 21}', "tool_name": "get_weather"}]
    r = oclient.chat(model="smollm2", messages=history, tools=[WEATHER], options=GREEDY)
    assert r.done and r.eval_count >= 1


def test_tool_calls_the_model_writes_come_back_as_ollama_tool_calls():
    # /api/chat has no grammar field; the parsing is the OpenAI route's (tested there), and
    # Ollama's shape of it is checked on a text the parser reads as a call.
    from pagedllm.server.ollama_shapes import ChatShape
    from pagedllm.tool_calls.spec import parse_tools, parse_tool_choice
    from pagedllm.tool_calls.syntax import template_tools
    from pagedllm.server.chat_prompt import ChatPrompt, ToolUse

    functions = parse_tools([WEATHER])
    use = ChatPrompt([], ToolUse(functions, parse_tool_choice(None, functions),
                                 template_tools(None)))
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    whole = ChatShape(use).whole(text)["message"]
    assert whole == {"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]}
    shape = ChatShape(use)
    lines = [shape.feed(text[:20]), shape.feed(text[20:]), shape.finish()]
    assert lines[0] is None and lines[1]["message"]["tool_calls"] == whole["tool_calls"]
    assert "tool_calls" not in lines[2]["message"]
    ollama.Message.model_validate(whole)  # the official client reads it


def test_a_reasoning_models_thinking_comes_back_as_ollama_thinking():
    from pagedllm.reasoning.splitter import PromptThinking
    from pagedllm.reasoning.syntax import SYNTAXES
    from pagedllm.server.chat_prompt import ChatPrompt
    from pagedllm.server.ollama_shapes import ChatShape, GenerateShape

    prompt = ChatPrompt([], None, PromptThinking(SYNTAXES["deepseek_r1"], inside=True))
    text = "Two and two.</think>It is 4."
    whole = ChatShape(prompt).whole(text)["message"]
    assert whole == {"role": "assistant", "content": "It is 4.", "thinking": "Two and two."}
    ollama.Message.model_validate(whole)
    shape = GenerateShape(prompt.thinking)
    lines = [shape.feed(text[:15]), shape.feed(text[15:]), shape.finish()]
    assert lines[0] == {"response": "", "thinking": "Two and two."}  # "</th" held back
    assert lines[1] == {"response": "It is 4."} and lines[2] == {"response": ""}


def test_model_listing_routes(oclient, server):
    models = oclient.list().models
    assert [m.model for m in models] == ["smollm2:latest"]
    assert models[0].details.format == "gguf" and models[0].details.quantization_level == "Q4_1"
    assert models[0].size > 50_000_000
    shown = oclient.show("smollm2")
    assert shown.details.family == "llama" and "tools" in shown.capabilities
    assert shown.modelinfo["llama.context_length"] > 0 and "im_start" in shown.template
    running = oclient.ps().models
    assert running[0].model == "smollm2:latest" and running[0].size > models[0].size
    assert httpx.get(server.url + "/api/version").json()["version"] == "0.1.0"


@pytest.mark.parametrize("method, path, body, status, words", [
    ("post", "/api/chat", {"model": "llama3", "messages": HI}, 404, "not found"),
    ("post", "/api/chat", {"messages": HI}, 400, "model is required"),
    ("post", "/api/chat", {"model": "smollm2", "messages": []}, 400, "messages"),
    ("post", "/api/chat", {"model": "smollm2", "messages": [
        {"role": "user", "content": "x", "images": ["aGk="]}]}, 400, "images"),
    ("post", "/api/chat", {"model": "smollm2", "messages": [{"role": "wizard", "content": "x"}]},
     400, "role"),
    ("post", "/api/chat", {"model": "smollm2", "messages": HI, "tools": [{"type": "function"}]},
     400, "tools[0].function"),
    ("post", "/api/chat", {"model": "smollm2", "messages": HI, "format": {"type": "strnig"}},
     400, "format"),
    ("post", "/api/chat", {"model": "smollm2", "messages": HI, "format": "xml"}, 400, "format"),
    ("post", "/api/chat", {"model": "smollm2", "messages": HI, "options": {"num_ctx": 10 ** 7}},
     400, "num_ctx"),
    ("post", "/api/chat", {"model": "smollm2", "messages": HI, "options": {"num_ctx": 8}},
     400, "num_ctx"),
    ("post", "/api/chat", {"model": "smollm2", "messages": HI, "options": {"temperature": "hot"}},
     400, "temperature"),
    ("post", "/api/generate", {"model": "smollm2", "prompt": "x", "images": ["aGk="]}, 400, "images"),
    ("post", "/api/generate", {"model": "smollm2", "prompt": "x", "suffix": "y"}, 400, "suffix"),
    ("post", "/api/generate", {"model": "smollm2", "prompt": "x", "options": {"num_predict": 0}},
     400, "num_predict"),
    ("post", "/api/pull", {"model": "llama3"}, 400, "does not do pulling"),
    ("delete", "/api/delete", {"model": "smollm2"}, 400, "deleting"),
    ("post", "/api/embed", {"model": "smollm2", "input": "x"}, 400, "embeddings"),
])
def test_bad_requests_get_ollamas_error_shape(server, method, path, body, status, words):
    r = httpx.request(method.upper(), server.url + path, json=body, timeout=60)
    assert r.status_code == status, r.text
    assert set(r.json()) == {"error"} and words in r.json()["error"], r.json()
    ok = httpx.post(server.url + "/api/generate", timeout=60, json={
        "model": "smollm2", "prompt": "Hi", "stream": False, "options": {"num_predict": 2}})
    assert ok.status_code == 200 and ok.json()["done"]


def test_malformed_json_and_the_load_request(server):
    r = httpx.post(server.url + "/api/chat", content=b'{"model": "smollm2", "messages": [',
                   headers={"Content-Type": "application/json"}, timeout=60)
    assert r.status_code == 400 and "not valid JSON at character 34" in r.json()["error"]
    loaded = httpx.post(server.url + "/api/generate", json={"model": "smollm2"}, timeout=60)
    assert loaded.json()["done_reason"] == "load" and loaded.json()["done"]


def test_a_body_without_a_json_content_type_is_read_as_json_as_ollama_does(server):
    """Ollama's own curl examples send `-d '{...}'`: curl calls that form-encoded."""
    body = json.dumps({"model": "smollm2", "prompt": "Hi", "stream": False,
                       "options": {"num_predict": 3, "temperature": 0}})
    for headers in ({}, {"Content-Type": "application/x-www-form-urlencoded"},
                    {"Content-Type": "text/plain"}):
        r = httpx.post(server.url + "/api/generate", content=body, headers=headers, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["eval_count"] == 3
    chat = httpx.post(server.url + "/api/chat", content=json.dumps(
        {"model": "smollm2", "messages": HI, "stream": False, "options": GREEDY}), timeout=120)
    assert chat.status_code == 200 and chat.json()["done"]
    # The OpenAI routes keep asking for JSON's type, as OpenAI's do.
    openai = httpx.post(server.url + "/v1/completions", content=json.dumps(
        {"model": "smollm2", "prompt": "Hi", "max_tokens": 2}), timeout=60,
        headers={"Content-Type": "text/plain"})
    assert openai.status_code == 400


def test_ollama_errors_name_ollamas_fields(server):
    r = httpx.post(server.url + "/api/generate", timeout=60, json={
        "model": "smollm2", "prompt": "Hi", "stream": False,
        "options": {"num_predict": 10_000_000}})
    assert r.status_code == 400 and r.json()["error"].startswith("options.num_predict: ")
    assert "max_tokens" not in r.json()["error"]
    r = httpx.post(server.url + "/api/chat", timeout=60, json={
        "model": "smollm2", "messages": HI, "stream": False, "options": {"top_p": 7}})
    assert r.status_code == 400 and "options.top_p" in r.json()["error"], r.json()
    r = httpx.post(server.url + "/v1/completions", timeout=60, json={
        "model": "smollm2", "prompt": "Hi", "max_tokens": 10_000_000})
    assert r.json()["error"]["param"] == "max_tokens"  # OpenAI's routes keep OpenAI's names


def test_ollama_routes_need_the_api_key_like_the_openai_routes(tmp_path):
    from server_process import ServerProcess

    keys = tmp_path / "keys.txt"
    keys.write_text("alice sk-alice-0123456789abcdef\n")
    keys.chmod(0o600)
    proc = ServerProcess("--dtype", "float32", "--kv-cache-memory", str(64 << 20),
                         "--api-key-file", str(keys), log_path=str(tmp_path / "log.txt"))
    try:
        refused = httpx.post(proc.url + "/api/chat", json={"model": "x", "messages": HI})
        assert refused.status_code == 401 and "API key" in refused.json()["error"]
        assert httpx.get(proc.url + "/api/tags").status_code == 401
        with pytest.raises(ollama.ResponseError) as info:
            ollama.Client(host=proc.url).list()
        assert info.value.status_code == 401
        keyed = ollama.Client(host=proc.url, headers={"Authorization": "Bearer sk-alice-0123456789abcdef"})
        name = keyed.list().models[0].model
        assert keyed.chat(model=name, messages=HI, options=GREEDY).eval_count == 12
    finally:
        proc.stop()
