"""A hostile or unlucky request cannot crash, stall or bypass the server: every bad field
gets a 400 naming it (then /health is 200 and a normal request still works), bodies are
bounded whatever their framing, one request's failure in the engine fails only that
request, and a burst fills the free slots before the queue counts."""
import asyncio
import concurrent.futures
import json

import httpx
import pytest
from soak import metric, soak_round, wait_idle

from pagedllm.core.request import SamplingParams

FAULT_SEED = 987_654_321  # a seed no fuzzer picks by chance


@pytest.fixture(scope="module")
def hardened(tmp_path_factory):
    from server_process import ServerProcess

    log = tmp_path_factory.mktemp("hardened") / "server.log"
    # A small KV pool: the soak test's rounds touch all of it in the first round (the pool
    # is mapped lazily, so a large one keeps growing resident until every block was used).
    proc = ServerProcess("--dtype", "float32", "--kv-cache-memory", str(32 << 20),
                         "--max-num-seqs", "8", "--max-queue", "2", "--max-tokens-limit", "16",
                         "--max-body-bytes", str(2 << 20), "--served-model-name", "smollm2",
                         log_path=str(log), env={"PAGEDLLM_TEST_FAIL_SAMPLING_SEED": str(FAULT_SEED)})
    yield proc
    proc.stop()


def _still_serving(url):
    assert httpx.get(url + "/health", timeout=10).status_code == 200
    ok = httpx.post(url + "/v1/completions", timeout=60,
                    json={"model": "smollm2", "prompt": "Hello", "max_tokens": 2})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


CHAT = {"model": "smollm2", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
COMPLETION = {"model": "smollm2", "prompt": "Hi", "max_tokens": 4}
BAD_FIELDS = [
    ("top_k", {"top_k": 2**63, "temperature": 1.0}),
    ("top_k", {"top_k": -5}),
    ("seed", {"seed": 2**64}),
    ("seed", {"seed": -(2**70)}),
    ("stop", {"stop": ["x" * 100_000] * 16}),
    ("stop", {"stop": [f"s{i}" for i in range(17)]}),
    ("stop_token_ids", {"stop_token_ids": [-1]}),
    ("stop_token_ids", {"stop_token_ids": [2**70]}),
    ("stop_token_ids", {"stop_token_ids": [49_152]}),  # one past the vocabulary
    ("stop_token_ids", {"stop_token_ids": [True]}),
    ("repetition_penalty", {"repetition_penalty": 5e-324}),
    ("repetition_penalty", {"repetition_penalty": 0}),
    ("temperature", {"temperature": -1}),
    ("temperature", {"temperature": 1e308}),
    ("top_p", {"top_p": 0}),
    ("n", {"n": 10**30}),
    ("max_tokens", {"max_tokens": 1e30}),
    ("max_tokens", {"max_tokens": -3}),
    ("max_tokens", {"max_tokens": 17}),  # over --max-tokens-limit
    ("presence_penalty", {"presence_penalty": 1e9}),
    ("logprobs", {"logprobs": 21}),
]


@pytest.mark.parametrize("param, fields", BAD_FIELDS)
@pytest.mark.parametrize("route, base", [("/v1/completions", COMPLETION),
                                         ("/v1/chat/completions", CHAT)])
def test_bad_fields_get_a_400_naming_the_field(hardened, route, base, param, fields):
    if param == "logprobs" and route.endswith("chat/completions"):
        fields, param = {"logprobs": True, "top_logprobs": 21}, "top_logprobs"
    r = httpx.post(hardened.url + route, json={**base, **fields}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["param"] or "").startswith(param), error  # pydantic names the element: "stop_token_ids.0"
    assert error["type"] == "invalid_request_error"
    assert "Overflow" not in error["message"] and "TypeError" not in error["message"]
    _still_serving(hardened.url)


def _raw(url, route, body: bytes, content_type="application/json"):
    return httpx.post(url + route, content=body, headers={"Content-Type": content_type},
                      timeout=60)


@pytest.mark.parametrize("route, body, status, param", [
    ("/v1/completions", b'{"model": "smollm2", "prompt": "a\\ud800b"}', 400, "prompt"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\udfff"}]}', 400,
     "messages.0.content"),
    ("/v1/completions", b'{"prompt": "x", "stop": ["\\ud83d"]}', 400, "stop.0"),
    ("/v1/completions", b'{"prompt": "ok \\ud83d\\ude00 pair"}', 200, None),  # a real pair
    ("/v1/completions", b'{"prompt": [false]}', 400, "prompt"),
    ("/v1/completions", b'{"prompt": []}', 400, "prompt"),
    ("/v1/completions", b'{"prompt": [99999999]}', 400, "prompt"),
    ("/v1/completions", b'{"prompt": "x", "temperature": NaN}', 400, "temperature"),
    ("/v1/completions", b'{"prompt": "x", "top_p": Infinity}', 400, "top_p"),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": 4', 400, None),  # invalid JSON
    ("/v1/completions", b'\xff\xfe{"prompt": "x"}', 400, None),  # not UTF-8
    ("/v1/completions", b'[1, 2]', 400, None),
    ("/v1/chat/completions", b'{"messages": [{"role": "wizard", "content": "x"}]}', 400,
     "messages.0.role"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": [{"type": "image_url", '
     b'"image_url": {"url": "http://x"}}]}]}', 400, "messages.0.content"),
    ("/v1/chat/completions", b'{"messages": []}', 400, "messages"),
])
def test_bad_bodies_are_refused_with_their_field(hardened, route, body, status, param):
    r = _raw(hardened.url, route, body.replace(b"{", b'{"max_tokens": 2, ', 1)
             if body.startswith(b"{") and b"max_tokens" not in body else body)
    assert r.status_code == status, r.text
    if status == 400:
        error = r.json()["error"]
        if param is not None:
            assert error["param"] is not None and error["param"].startswith(param), error
    _still_serving(hardened.url)


def test_wrong_content_type_and_huge_prompts(hardened):
    r = _raw(hardened.url, "/v1/completions", b"prompt=hi", "application/x-www-form-urlencoded")
    assert r.status_code == 400
    r = httpx.post(hardened.url + "/v1/completions", timeout=120,
                   json={"prompt": [5] * 100_000, "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    _still_serving(hardened.url)


def test_the_body_limit_holds_for_chunked_bodies_too(hardened):
    def chunks():  # no Content-Length: httpx sends it chunked
        yield b'{"prompt": "'
        for _ in range(300):
            yield b"x" * 10_000
        yield b'"}'

    r = httpx.post(hardened.url + "/v1/completions", content=chunks(),
                   headers={"Content-Type": "application/json"}, timeout=60)
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"
    small = httpx.post(hardened.url + "/v1/completions", content=iter([b'{"prompt": "Hi", ',
                                                                        b'"max_tokens": 2}']),
                       headers={"Content-Type": "application/json"}, timeout=60)
    assert small.status_code == 200  # a small chunked body is read whole
    _still_serving(hardened.url)


def test_a_trickled_body_is_cut_off_after_the_timeout():
    from pagedllm.server.middleware import BodyGuard

    reached = []

    async def app(scope, receive, send):
        reached.append((await receive())["body"])

    async def run(delays):
        sent = []

        async def receive():
            await asyncio.sleep(delays.pop(0) if delays else 10)
            return {"type": "http.request", "body": b"{}", "more_body": bool(delays)}

        async def send(message):
            sent.append(message)

        guard = BodyGuard(app, max_bytes=1000, timeout=0.3)
        await guard({"type": "http", "method": "POST", "path": "/v1/completions", "headers": []},
                    receive, send)
        return sent

    sent = asyncio.run(run([0.2, 0.2, 0.2]))
    assert sent[0]["status"] == 408 and not reached
    assert json.loads(sent[1]["body"])["error"]["code"] == "request_timeout"
    assert asyncio.run(run([0.0, 0.0])) == [] and reached == [b"{}{}"]


def test_leaving_max_tokens_out_cannot_pass_the_servers_limit(hardened):
    for body in ({}, {"max_tokens": None}, {"max_completion_tokens": None}):
        r = httpx.post(hardened.url + "/v1/chat/completions", timeout=60, json={
            "model": "smollm2", "messages": [{"role": "user", "content": "Tell a long story."}],
            "ignore_eos": True, **body})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 16
        assert r.json()["choices"][0]["finish_reason"] == "length"


def _stream(url, seed=None):
    body = {"model": "smollm2", "prompt": "Once upon a time", "max_tokens": 16, "stream": True,
            "temperature": 0, "ignore_eos": True}
    if seed is not None:
        body["seed"] = seed
    events = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
    return events


def test_one_requests_fault_fails_it_alone_and_every_stream_ends(hardened):
    alone = _stream(hardened.url)
    text_alone = "".join(json.loads(e)["choices"][0]["text"] for e in alone[:-1]
                         if json.loads(e)["choices"])
    with concurrent.futures.ThreadPoolExecutor(5) as pool:
        runs = [pool.submit(_stream, hardened.url, FAULT_SEED if i == 2 else None) for i in range(5)]
        results = [f.result() for f in runs]
    for i, events in enumerate(results):
        assert events[-1] == "[DONE]"  # every stream ends, the failed one too
        chunks = [json.loads(e) for e in events[:-1]]
        if i == 2:
            error = chunks[-1]["error"]
            assert "failed in the engine" in error["message"] and "injected" in error["message"]
        else:
            assert "".join(c["choices"][0]["text"] for c in chunks) == text_alone
    metrics = httpx.get(hardened.url + "/metrics").text
    assert 'finished_reason="error"' in metrics
    whole = httpx.post(hardened.url + "/v1/completions", timeout=60, json={
        "prompt": "Hi", "max_tokens": 4, "seed": FAULT_SEED})
    assert whole.status_code == 500 and whole.json()["error"]["code"] == "request_failed"
    usage = [line for line in httpx.get(hardened.url + "/metrics").text.splitlines()
             if line.startswith("pagedllm:kv_cache_usage_perc")]
    assert usage and float(usage[0].split()[-1]) == 0.0  # no block leaked
    _still_serving(hardened.url)


def test_a_burst_fills_the_free_slots_before_the_queue_counts(hardened):
    # 8 slots and a queue of 2: a burst of 10 all get in, whatever the engine has scheduled.
    def one(i):
        return httpx.post(hardened.url + "/v1/completions", timeout=120, json={
            "prompt": f"Item {i}:", "max_tokens": 8, "ignore_eos": True})

    with concurrent.futures.ThreadPoolExecutor(10) as pool:
        codes = [r.status_code for r in pool.map(one, range(10))]
    assert codes == [200] * 10


# -- the engine, in process ------------------------------------------------------------------

def test_a_grammar_the_library_gives_up_on_ends_its_request_with_an_error(real_llm):
    """Not a "stop" the grammar does not accept (the library's failed walk allows only the
    end token): finish_reason "error", naming why; the request beside it is untouched."""
    from pagedllm.structured.spec import GrammarSpec

    engine = real_llm.engine
    spec = GrammarSpec("regex", "a{5}", "guided_regex")
    engine.add_request("given-up", "Say a:", SamplingParams(max_tokens=8, guided=spec))
    engine.add_request("bystander", "Hello", SamplingParams(max_tokens=4, ignore_eos=True))
    walk = engine.runner.sequences["given-up"].grammar._matcher

    class GivenUp:  # the library's own error state, as after a limit was hit
        def __getattr__(self, name):
            return getattr(walk, name)

        def is_error(self):
            return True

        def get_error(self):
            return "step_max_items limit exceeded"

    engine.runner.sequences["given-up"].grammar._matcher = GivenUp()
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    given_up = finished["given-up"]
    assert given_up.finish_reason == "error" and given_up.token_ids == []
    assert "structured output failed" in given_up.error and "step_max_items" in given_up.error
    assert finished["bystander"].finish_reason == "length"


def test_engine_fails_the_faulty_request_alone_with_the_same_tokens_for_the_rest(real_llm):
    engine = real_llm.engine
    prompts = ["The sky is", "Cats are", "Paris is", "Numbers are"]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    seeded = SamplingParams(max_tokens=12, temperature=1.0, seed=5, ignore_eos=True)
    expected = [o.token_ids for o in real_llm.generate(prompts, params)]
    expected_seeded = real_llm.generate(["Dogs are"], seeded)[0].token_ids

    def fault(request_id, row):
        if request_id == "bad" and len(row.output_token_ids) >= 3:
            raise RuntimeError("boom")

    engine.runner.fault_injector = fault
    try:
        for i, p in enumerate(prompts):
            engine.add_request(f"ok{i}", p, params)
        engine.add_request("seeded", "Dogs are", seeded)
        engine.add_request("bad", "Birds are", params)
        finished = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = out
    finally:
        engine.runner.fault_injector = None
    bad = finished["bad"]
    assert bad.finish_reason == "error" and "boom" in bad.error and len(bad.token_ids) == 3
    assert [finished[f"ok{i}"].token_ids for i in range(4)] == expected
    assert finished["seeded"].token_ids == expected_seeded
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_blocks
    assert engine.runner.sequences == {} and not engine.has_unfinished_requests()


def test_a_failed_model_step_fails_its_requests_and_the_engine_goes_on(real_llm, monkeypatch):
    engine = real_llm.engine
    calls = {"n": 0}
    forward = engine.runner.model.forward

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("kernel fault")
        return forward(*args, **kwargs)

    monkeypatch.setattr(engine.runner.model, "forward", flaky)
    engine.add_request("a", "Hello there", SamplingParams(max_tokens=8, temperature=0.0))
    engine.add_request("b", "Good morning", SamplingParams(max_tokens=8, temperature=0.0))
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert {o.finish_reason for o in finished.values()} == {"error"}
    assert all("kernel fault" in o.error for o in finished.values())
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_blocks
    after = real_llm.generate(["Hello there"], SamplingParams(max_tokens=4, temperature=0.0))[0]
    assert after.finish_reason == "length" and len(after.token_ids) == 4


def test_repeated_engine_faults_mark_the_engine_dead_and_end_every_stream(real_llm, monkeypatch):
    from pagedllm.engine.async_engine import AsyncEngine
    from pagedllm.errors import EngineDeadError

    engine = real_llm.engine
    monkeypatch.setattr(engine, "step", lambda: (_ for _ in ()).throw(RuntimeError("broken")))
    async def main():
        async_engine = AsyncEngine(engine)
        streams = [async_engine.submit(engine.make_request(f"r{i}", "Hi", SamplingParams(max_tokens=4)))
                   for i in range(3)]
        errors = []
        for stream in streams:
            with pytest.raises(EngineDeadError) as info:
                async for _ in stream:
                    pass
            errors.append(str(info.value))
        for i in range(2):  # two more faults: three in a row
            stream = async_engine.submit(engine.make_request(f"s{i}", "Hi", SamplingParams(max_tokens=4)))
            with pytest.raises(EngineDeadError):
                async for _ in stream:
                    pass
        async_engine.shutdown()
        return errors, async_engine

    errors, async_engine = asyncio.run(asyncio.wait_for(main(), 60))
    assert all("broken" in e for e in errors)
    assert async_engine.dead.startswith("3 engine steps failed in a row")
    assert not async_engine._thread.is_alive()  # the loop ended with the engine
    assert not engine.has_unfinished_requests()


def test_schemathesis_finds_no_server_error_and_no_schema_violation(hardened):
    """The server's own OpenAPI schema, fuzzed: no 5xx, every response as documented
    (status, content type, body), schema-invalid requests refused. Bounded: a fixed seed,
    a time budget, max_tokens capped by the server's --max-tokens-limit. Not checked:
    "schema-valid requests accepted" (the schema cannot say which model name exists or
    that token ids stay below the vocabulary)."""
    import os
    import subprocess
    import sys

    command = [os.path.join(os.path.dirname(sys.executable), "schemathesis"), "run",
               hardened.url + "/openapi.json", "--checks", "all",
               "--exclude-checks", "positive_data_acceptance", "--max-examples", "6",
               "--workers", "1", "--seed", "1", "--max-time", "35", "--request-timeout", "60"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-6000:]
    assert " passed" in done.stdout and "failed" not in done.stdout.split("Test cases:")[-1]
    _still_serving(hardened.url)


# -- soak ------------------------------------------------------------------------------------

def test_soak_disconnects_and_429s_leave_nothing_behind(hardened):
    import psutil

    rss = []
    for round_seed in (1, 2):
        # Six waves of 16 a round: about 60 admitted (8 slots, a queue of 2), half dropped.
        results = soak_round(hardened.url, round_seed, num_requests=96)
        kinds = [kind for kind, _ in results]
        print("soak round", round_seed, {kind: kinds.count(kind) for kind in set(kinds)})
        assert kinds.count("429") > 0 and kinds.count("dropped") > 10 and kinds.count("full") > 10
        assert all(tokens == 12 for kind, tokens in results if kind == "full")  # nothing lost
        wait_idle(hardened.url)
        rss.append(psutil.Process(hardened.proc.pid).memory_info().rss)
    _still_serving(hardened.url)
    growth = rss[1] - rss[0]
    print(f"soak RSS: {rss[0] / 2**20:.0f} MiB after round 1, {rss[1] / 2**20:.0f} MiB after round 2")
    # Seen here: +3 MiB, then +1 and +0 over two more rounds (BENCHMARKS.md has the series).
    assert growth < 16 * 2**20, f"RSS grew {growth / 2**20:.0f} MiB between soak rounds"


def test_under_memory_pressure_new_requests_wait_and_still_complete(tmp_path):
    from server_process import ServerProcess

    # A 1-byte bound: the process is always "over", so requests run one at a time.
    proc = ServerProcess("--dtype", "float32", "--kv-cache-memory", str(32 << 20),
                         "--max-memory", "1", log_path=str(tmp_path / "log"))
    try:
        def one(i):
            return httpx.post(proc.url + "/v1/completions", timeout=120, json={
                "prompt": f"Item {i}:", "max_tokens": 6, "ignore_eos": True})

        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            responses = list(pool.map(one, range(3)))
        assert [r.json()["usage"]["completion_tokens"] for r in responses] == [6, 6, 6]
        assert metric(proc.url, "memory_pressure") == 1.0
        assert "memory pressure" in proc.output() and "new requests wait" in proc.output()
    finally:
        proc.stop()


def test_slow_headers_are_cut_off_and_connections_per_client_are_bounded(tmp_path):
    import socket
    import time

    from server_process import ServerProcess

    proc = ServerProcess("--dtype", "float32", "--kv-cache-memory", str(32 << 20),
                         "--header-timeout", "1", "--max-connections-per-client", "3",
                         log_path=str(tmp_path / "log"))

    def connect():
        return socket.create_connection(("127.0.0.1", proc.port), timeout=10)

    try:
        slow = connect()
        slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # and never the rest
        started = time.monotonic()
        answer = slow.recv(4096)
        assert answer.startswith(b"HTTP/1.1 408") and b"headers did not arrive" in answer
        assert time.monotonic() - started < 5 and slow.recv(4096) == b""  # then closed
        huge = connect()  # headers over 32 KiB, sent at once
        huge.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 65536 + b"\r\n\r\n")
        assert huge.recv(4096).startswith(b"HTTP/1.1 431")
        huge.close()
        time.sleep(0.2)
        held = [connect() for _ in range(3)]
        extra = connect()
        answer = extra.recv(4096)
        assert answer.startswith(b"HTTP/1.1 429") and b"too many open connections" in answer
        for sock in held + [extra, slow]:
            sock.close()
        time.sleep(0.2)
        ok = httpx.post(proc.url + "/v1/completions", timeout=60,
                        json={"prompt": "Hi", "max_tokens": 2})  # the slots came back
        assert ok.status_code == 200
        with httpx.Client(timeout=60) as client:  # keep-alive: several requests, one connection
            assert [client.get(proc.url + "/health").status_code for _ in range(3)] == [200] * 3
    finally:
        proc.stop()


def test_a_prompt_far_past_the_context_is_refused_before_it_is_tokenized(hardened):
    from pagedllm.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_model_path(None)
    text = "word " * 400_000  # 2 MB less a little: under the body limit
    assert tokenizer.min_tokens(text) <= len(tokenizer.encode(text))  # a true lower bound
    for route, body in (("/v1/completions", {"prompt": text}),
                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": text}]})):
        r = httpx.post(hardened.url + route, json={**body, "max_tokens": 2}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        assert "at least" in r.json()["error"]["message"]
    _still_serving(hardened.url)


def test_a_broken_engine_ends_every_stream_reports_503_and_exits_70(tmp_path):
    from server_process import ServerProcess

    proc = ServerProcess("--dtype", "float32", "--kv-cache-memory", str(32 << 20),
                         "--served-model-name", "smollm2", log_path=str(tmp_path / "log"),
                         env={"PAGEDLLM_TEST_BREAK_ENGINE": "1"})
    try:
        for _ in range(3):  # three failed steps in a row: the engine counts as dead
            events = _stream(proc.url)
            assert events[-1] == "[DONE]" and "engine error" in events[-2]
            # before the error, the choice's own end: a finish_reason and why
            [last] = json.loads(events[-3])["choices"]
            assert last["finish_reason"] == "length"
            assert last["error"]["type"] == "request_cut_short"
            assert "the engine stopped serving it" in last["error"]["message"]
        assert proc.proc.wait(60) == 70
        assert "engine unusable" in proc.output() and "exiting" in proc.output()
    finally:
        proc.stop()


def test_health_is_503_while_the_engine_is_unusable(real_llm):
    from fastapi.testclient import TestClient

    from pagedllm.server.app import create_app
    from pagedllm.serving.local import LocalEngineClient

    engine_client = LocalEngineClient(real_llm.engine)
    app = create_app(engine_client, "smollm2")
    with TestClient(app) as client:
        assert client.get("/health").status_code == 200
        engine_client.loop.core.dead = "3 engine steps failed in a row: boom"
        r = client.get("/health")
        assert r.status_code == 503 and "boom" in r.json()["error"]["message"]


def test_a_request_whose_adapter_is_unloaded_as_it_starts_is_a_404(real_llm, monkeypatch):
    """Checked when made, unloaded before the engine takes it: the engine refuses it alone,
    and the client hears 404 model_not_found (not a 500)."""
    import dataclasses

    from fastapi.testclient import TestClient

    from pagedllm.server.app import create_app
    from pagedllm.serving.local import LocalEngineClient

    engine_client = LocalEngineClient(real_llm.engine, start_thread=True)
    made = engine_client.make_request

    def made_then_unloaded(*args, **kwargs):
        request = made(*args, **kwargs)
        request.params = dataclasses.replace(request.params, lora="sql")  # gone by now
        return request
    monkeypatch.setattr(engine_client, "make_request", made_then_unloaded)
    app = create_app(engine_client, "smollm2")
    try:
        with TestClient(app) as client:
            r = client.post("/v1/completions", json={"model": "smollm2", "prompt": "Hi",
                                                     "max_tokens": 2})
            assert r.status_code == 404, r.text
            error = r.json()["error"]
            assert error["code"] == "model_not_found" and error["param"] == "model"
            assert "the adapter sql is not loaded" in error["message"]
    finally:
        engine_client.shutdown()
    assert real_llm.engine.kv_manager.num_free_blocks == real_llm.engine.kv_manager.num_blocks


def test_a_stalled_engine_and_the_instant_after_a_crash_are_503s(real_llm, monkeypatch):
    """/health and new requests while the engine makes no progress; a request whose submit
    finds no engine (the instant after an engine process died): 503, never a 500."""
    from fastapi.testclient import TestClient

    from pagedllm.errors import EngineUnavailableError
    from pagedllm.server.app import create_app
    from pagedllm.serving.local import LocalEngineClient

    engine_client = LocalEngineClient(real_llm.engine)
    app = create_app(engine_client, "smollm2")
    body = {"model": "smollm2", "prompt": "Hi", "max_tokens": 2}
    with TestClient(app) as client:
        engine_client.stalled = "the engine process has made no progress for 40 s"
        for r in (client.get("/health"), client.post("/v1/completions", json=body)):
            assert r.status_code == 503 and r.json()["error"]["code"] == "engine_stalled"
            assert "40 s" in r.json()["error"]["message"] and r.headers["retry-after"]
        engine_client.stalled = None

        def gone(request, report_position=False):
            raise EngineUnavailableError("the engine process is not running")
        monkeypatch.setattr(engine_client, "submit", gone)
        r = client.post("/v1/completions", json={**body, "n": 2})
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_restarting"
        assert "not running" in r.json()["error"]["message"]
