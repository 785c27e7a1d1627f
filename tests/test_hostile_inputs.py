"""The regression corpus (hostile_corpus.py) through the real server: every input that once
killed the process (grammar chains), froze it or got a 500 (bodies and texts that recurse)
gets a 4xx naming what is wrong, the process lives, and a bystander's stream that runs
meanwhile ends as it would have."""
import concurrent.futures
import json

import httpx
import pytest
from hostile_corpus import corpus


def _stream_tokens(url: str, max_tokens: int) -> tuple[int, str | None]:
    """A bystander: a streamed completion; (chunks with text, its finish_reason)."""
    chunks, reason = 0, None
    body = {"model": "smollm2", "prompt": "Once upon a time", "max_tokens": max_tokens,
            "ignore_eos": True, "stream": True, "temperature": 0}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            choice = json.loads(line[6:])["choices"][0]
            chunks += bool(choice["text"])
            reason = choice["finish_reason"] or reason
    return chunks, reason


def _send(url: str, route: str, body) -> httpx.Response:
    if isinstance(body, bytes):
        return httpx.post(url + route, content=body, timeout=120,
                          headers={"Content-Type": "application/json"})
    return httpx.post(url + route, json=body, timeout=120)


@pytest.mark.parametrize("name,route,body", corpus(), ids=[row[0] for row in corpus()])
def test_each_hostile_input_is_a_clean_4xx(server, name, route, body):
    if isinstance(body, dict) and route.startswith("/v1"):
        body = {"model": "smollm2", **body}
    response = _send(server.url, route, body)
    assert 400 <= response.status_code < 500, (name, response.status_code, response.text[:300])
    error = response.json()["error"]
    assert (error if route.startswith("/api/") else error["message"]), name
    assert server.proc.poll() is None, f"{name}: the server process died"
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


def test_a_bystander_streams_on_while_the_corpus_is_sent(server):
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        bystander = pool.submit(_stream_tokens, server.url, 48)
        statuses = []
        for _name, route, body in corpus():
            if isinstance(body, dict) and route.startswith("/v1"):
                body = {"model": "smollm2", **body}
            statuses.append(_send(server.url, route, body).status_code)
        chunks, reason = bystander.result(timeout=300)
    assert all(400 <= s < 500 for s in statuses), statuses
    assert reason == "length" and chunks >= 40  # it ran to its end, untouched
    assert server.proc.poll() is None


def test_a_prompt_list_past_the_cap_is_one_400_not_thousands_of_requests(server):
    response = httpx.post(server.url + "/v1/completions", timeout=60, json={
        "model": "smollm2", "prompt": ["hi"] * 20_000, "max_tokens": 1})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "too_many_prompts" and error["param"] == "prompt"
    assert "--max-prompts-per-request" in error["message"]


def test_an_ollama_raw_prompt_past_the_context_is_refused_without_tokenizing_it_all(server):
    response = httpx.post(server.url + "/api/generate", timeout=60, json={
        "model": "smollm2", "raw": True, "stream": False, "prompt": "word " * 800_000})
    assert response.status_code == 400
    assert "maximum context length" in response.json()["error"]
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


def test_the_server_answers_while_a_costly_schema_compiles(server):
    """The schema of 300 patterns once froze every client for 16 s (compiled on the event
    loop, then again per choice): now it compiles in the child, then once on a worker
    thread, and /health answers every poll meanwhile."""
    import time

    schema = {"type": "object", "patternProperties": {
        f"^p{i}[a-z]*$": {"type": "integer"} for i in range(300)}}
    body = {"model": "smollm2", "n": 4, "max_tokens": 4,
            "messages": [{"role": "user", "content": "hi"}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}
    polls = []
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        costly = pool.submit(httpx.post, server.url + "/v1/chat/completions", json=body,
                             timeout=300)
        while not costly.done():
            polls.append(httpx.get(server.url + "/health", timeout=10).status_code)
            time.sleep(0.05)
    assert costly.result().status_code in (200, 400)  # compiled, or refused past its time
    assert polls and set(polls) == {200}
