"""The HTTP server, through the official openai client and raw HTTP, against a real process."""
import concurrent.futures
import json
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

MODEL = "smollm2"


def metrics(server) -> dict[str, float]:
    text = httpx.get(server.url + "/metrics").text
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if not sample.labels.get("le"):
                values[sample.name] = values.get(sample.name, 0) + sample.value
    return values


def observed(values: dict[str, float], name: str) -> float:
    """A histogram's count; labelled histograms have no samples before their first
    observation (a fresh server)."""
    return values.get(name, 0.0)


def test_models(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    card = models.data[0].model_extra  # what is served, beyond OpenAI's fields
    assert card["architecture"] == "llama" and card["quantization"] == "Q4_1"
    assert card["context_length"] == card["max_model_len"] > 0 and card["dtype"]


def test_retrieving_one_model_by_id(client, server):
    """The openai SDK's models.retrieve (GET /v1/models/{id}): the list's entry; an unknown
    id is a 404 in OpenAI's error shape, model_not_found."""
    model = client.models.retrieve(MODEL)
    listed = client.models.list().data[0]
    assert model.id == MODEL and model.object == "model"
    assert model.model_dump() == listed.model_dump()
    with pytest.raises(openai.NotFoundError) as caught:
        client.models.retrieve("no-such-model")
    assert caught.value.body["code"] == "model_not_found" and caught.value.body["param"] == "model"
    # a name with a slash reaches the route too (as served names of folders have), and the
    # route without /v1 answers as /models does
    assert httpx.get(server.url + "/v1/models/org/no-such-model").status_code == 404
    assert httpx.get(server.url + f"/models/{MODEL}").json()["id"] == MODEL


def test_completion(client):
    out = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8,
                                    temperature=0)
    assert "Paris" in out.choices[0].text
    assert out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 8 and out.usage.prompt_tokens == 5
    assert out.usage.total_tokens == 13


def test_completion_streaming_equals_non_streaming(client):
    kwargs = dict(model=MODEL, prompt="Once upon a time", max_tokens=20, temperature=0)
    whole = client.completions.create(**kwargs).choices[0].text
    chunks = list(client.completions.create(stream=True, **kwargs))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole
    assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_and_streaming_chat(client):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0)
    assert out.choices[0].message.role == "assistant"
    assert "Paris" in out.choices[0].message.content
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == out.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == out.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == out.usage.prompt_tokens


def test_chat_content_parts_and_system(client):
    out = client.chat.completions.create(
        model=MODEL, max_completion_tokens=5, temperature=0,
        messages=[{"role": "system", "content": "You answer in one word."},
                  {"role": "user", "content": [{"type": "text", "text": "Capital of "},
                                               {"type": "text", "text": "France?"}]}])
    assert out.choices[0].message.content
    assert out.usage.completion_tokens <= 5


def test_n_samples_share_prompt_blocks(client):
    prompt = "Write a list of fruits: apple, banana, cherry, " * 4
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0.9,
                                    n=2, seed=5)
    assert [c.index for c in out.choices] == [0, 1]
    assert out.usage.completion_tokens == 16
    assert out.usage.prompt_tokens_details.cached_tokens >= 32  # the second sample reused blocks


def test_multiple_prompts(client):
    out = client.completions.create(model=MODEL, prompt=["One, two,", "Red, green,"], max_tokens=3,
                                    temperature=0)
    assert len(out.choices) == 2 and all(c.text for c in out.choices)


def test_stop_strings(client):
    out = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=20,
                                    temperature=0, stop=[", 7"])
    assert out.choices[0].text == " 5, 6" and out.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=20,
                                            temperature=0, stop=", 7", stream=True))
    assert "".join(c.choices[0].text for c in chunks) == " 5, 6"


def test_logprobs(client):
    out = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=3,
                                    temperature=0, logprobs=2)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == 3 and len(lp.token_logprobs) == 3 and len(lp.top_logprobs[0]) == 2
    assert "".join(lp.tokens) == out.choices[0].text
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=3, temperature=0, logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and len(content[0].top_logprobs) == 3
    assert content[0].logprob <= 0


def test_seed_reproduces(client):
    kwargs = dict(model=MODEL, prompt="My favourite animal is", max_tokens=16, temperature=1.0, seed=42)
    first = client.completions.create(**kwargs).choices[0].text
    assert client.completions.create(**kwargs).choices[0].text == first
    others = {client.completions.create(**{**kwargs, "seed": s}).choices[0].text for s in range(3)}
    assert len(others | {first}) > 1


def test_token_id_prompt_and_penalties(client):
    ids = httpx.post(client.base_url.join("/tokenize").__str__().replace("/v1/tokenize", "/tokenize"),
                     json={"prompt": "Hello"}).json()["tokens"]
    out = client.completions.create(model=MODEL, prompt=ids, max_tokens=4, temperature=0,
                                    extra_body={"repetition_penalty": 1.2, "top_k": 5, "min_p": 0.1},
                                    presence_penalty=0.5, frequency_penalty=0.5)
    assert out.usage.prompt_tokens == len(ids)


def test_tokenize_detokenize_round_trip(server):
    text = "Hello 世界 🎉 <|im_end|>"
    tokens = httpx.post(server.url + "/tokenize", json={"prompt": text}).json()
    assert tokens["count"] == len(tokens["tokens"])
    back = httpx.post(server.url + "/detokenize", json={"tokens": tokens["tokens"]}).json()
    assert back["prompt"] == text
    chat = httpx.post(server.url + "/tokenize",
                      json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["count"] > 5


def test_metrics_describe_the_kv_cache(server):
    text = httpx.get(server.url + "/metrics").text
    [family] = [f for f in text_string_to_metric_families(text) if f.name == "pagedllm:cache_config_info"]
    [sample] = family.samples
    assert sample.value == 1
    assert sample.labels["cache_dtype"] == "auto" and sample.labels["block_size"] == "16"
    assert int(sample.labels["num_blocks"]) > 0 and sample.labels["enable_prefix_caching"] == "True"


def test_metrics_move(client, server):
    before = metrics(server)
    client.completions.create(model=MODEL, prompt="Counting", max_tokens=5, temperature=0,
                              extra_body={"ignore_eos": True})
    after = metrics(server)
    assert after["pagedllm:generation_tokens_total"] == before["pagedllm:generation_tokens_total"] + 5
    assert after["pagedllm:prompt_tokens_total"] > before["pagedllm:prompt_tokens_total"]
    assert observed(after, "pagedllm:e2e_request_latency_seconds_count") == \
        observed(before, "pagedllm:e2e_request_latency_seconds_count") + 1
    assert observed(after, "pagedllm:time_to_first_token_seconds_count") > \
        observed(before, "pagedllm:time_to_first_token_seconds_count")
    assert observed(after, "pagedllm:request_queue_time_seconds_count") > \
        observed(before, "pagedllm:request_queue_time_seconds_count")
    for name in ("pagedllm:num_requests_running", "pagedllm:num_requests_waiting",
                 "pagedllm:kv_cache_usage_perc", "pagedllm:prefix_cache_queries_total",
                 "pagedllm:prefix_cache_hits_total", "pagedllm:num_preemptions_total",
                 "pagedllm:time_per_output_token_seconds_count"):
        assert name in after


# -- errors ---------------------------------------------------------------------------------

def error_of(response) -> dict:
    body = response.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


@pytest.mark.parametrize("field,value", [("temperature", -1), ("top_p", 2), ("max_tokens", 0),
                                         ("n", 100), ("presence_penalty", 5), ("logprobs", 99),
                                         ("stop", ["x"] * 20), ("top_k", -3)])
def test_invalid_field_is_400_naming_it(server, field, value):
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", field: value})
    assert r.status_code == 400
    err = error_of(r)
    assert err["param"] == field and field in err["message"]


def test_invalid_chat_messages(server):
    for body in ({"messages": []}, {"messages": [{"role": "wizard", "content": "x"}]},
                 {"messages": "hello"}, {}):
        r = httpx.post(server.url + "/v1/chat/completions", json=body)
        assert r.status_code == 400, body
        assert error_of(r)["param"].startswith("messages")


def test_prompt_too_long_names_both_numbers(server):
    r = httpx.post(server.url + "/v1/completions",
                   json={"prompt": [5] * 8000, "max_tokens": 500})
    assert r.status_code == 400
    message = error_of(r)["message"]
    assert "8192" in message and "8000" in message and "500" in message


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="gpt-99", prompt="hi", max_tokens=1)
    assert info.value.body["param"] == "model"


def test_oversized_body_is_413(server):
    r = httpx.post(server.url + "/v1/completions", content=b'{"prompt": "' + b"a" * (5 << 20) + b'"}',
                   headers={"content-type": "application/json"})
    assert r.status_code == 413
    assert error_of(r)["code"] == "body_too_large"


def test_malformed_json_and_bad_token_ids(server):
    r = httpx.post(server.url + "/v1/completions", content=b"{not json",
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and error_of(r)["type"] == "invalid_request_error"
    r = httpx.post(server.url + "/v1/completions", json={"prompt": [10**9], "max_tokens": 1})
    assert r.status_code == 400 and error_of(r)["param"] == "prompt"
    r = httpx.post(server.url + "/detokenize", json={"tokens": [-1]})
    assert r.status_code == 400 and error_of(r)["param"] == "tokens"
    r = httpx.post(server.url + "/v1/completions", json={"prompt": ""})
    assert r.status_code == 400


def test_bad_requests_do_not_disturb_good_ones(client, server):
    expected = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=12,
                                         temperature=0).choices[0].text

    def good():
        return client.completions.create(model=MODEL, prompt="The sky is", max_tokens=12,
                                         temperature=0).choices[0].text

    def bad(i):
        return httpx.post(server.url + "/v1/completions",
                          json={"prompt": "x", "temperature": "hot" if i % 2 else -5}).status_code

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        goods = [pool.submit(good) for _ in range(4)]
        bads = [pool.submit(bad, i) for i in range(8)]
        assert [f.result() for f in goods] == [expected] * 4
        assert [f.result() for f in bads] == [400] * 8
    assert httpx.get(server.url + "/health").status_code == 200


# -- concurrency and disconnects -------------------------------------------------------------

def test_sixteen_concurrent_streams_equal_alone(client):
    prompts = [f"Story number {i}: once upon a time there was a" for i in range(16)]

    def run(prompt):
        stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8,
                                           temperature=0, stream=True)
        return "".join(c.choices[0].text for c in stream if c.choices)

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        together = list(pool.map(run, prompts))
    alone = [client.completions.create(model=MODEL, prompt=p, max_tokens=8, temperature=0)
             .choices[0].text for p in prompts]
    assert together == alone


def wait_idle(server, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = metrics(server)
        if m["pagedllm:num_requests_running"] == 0 and m["pagedllm:num_requests_waiting"] == 0:
            return m
        time.sleep(0.05)
    raise AssertionError(f"server still busy: {m}")


def test_disconnect_mid_stream_aborts_and_frees_blocks(server):
    body = {"prompt": "Tell me a very long story.", "max_tokens": 2000, "temperature": 0,
            "ignore_eos": True, "stream": True}
    # The module's server is shared: an earlier test's request still running would make
    # the count below 2, not 1 (this test failed that way twice on a loaded host).
    wait_idle(server, timeout=60)
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        # Seen running while the stream is still being read: once the reading stops, the
        # client may already count as gone (and the request be aborted) before a scrape.
        lines, running = 0, False
        for line in r.iter_lines():
            lines += line.startswith("data: ")
            if lines >= 3 and metrics(server)["pagedllm:num_requests_running"] == 1:
                running = True
                break
            assert lines < 1000, "the stream ran on without the request counting as running"
        assert running
    m = wait_idle(server)
    assert m["pagedllm:kv_cache_usage_perc"] == 0.0
    # The server goes on serving (and counting) after the abort.
    after = httpx.post(server.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
    assert after.status_code == 200
    assert metrics(server)["pagedllm:request_success_total"] >= 1


def test_sse_format_ends_with_done(server):
    body = {"prompt": "Hi", "max_tokens": 3, "stream": True}
    text = httpx.post(server.url + "/v1/completions", json=body).text
    events = [e for e in text.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[0][6:])["object"] == "text_completion"
