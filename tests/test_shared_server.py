"""Shared-server controls against real server processes: binding, keys, fairness, limits."""
import concurrent.futures
import json
import shutil
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from server_process import ServerProcess, free_port

KEYS = {"alice": "alice-key-0123456789", "bob": "bob-key-0123456789",
        "metered": "metered-key-0123456789"}
LONG_PROMPT = "The committee met on Tuesday to review the budget for the coming year. " * 12


def write_keys(path, extra=""):
    path.write_text(
        "# name key options\n"
        f"alice {KEYS['alice']} weight=1\n"
        f"bob {KEYS['bob']} weight=1 max_concurrent=2\n"
        f"metered {KEYS['metered']} tokens_per_minute=200\n" + extra)


def auth(name):
    return {"Authorization": f"Bearer {KEYS[name]}"}


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    folder = tmp_path_factory.mktemp("keyed")
    keys = folder / "keys.txt"
    write_keys(keys)
    proc = ServerProcess("--host", "0.0.0.0", "--api-key-file", str(keys), "--kv-cache-memory",
                         str(256 << 20), "--max-num-seqs", "2", "--max-queue", "60",
                         "--allowed-origins", "http://app.example", "--served-model-name", "m",
                         host="0.0.0.0", log_path=str(folder / "log"))
    proc.keys_path = keys
    yield proc
    proc.stop()


def complete(server, key, prompt="Hello", max_tokens=4, **extra):
    return httpx.post(server.url + "/v1/completions", headers=auth(key) if key else {},
                      json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra},
                      timeout=120)


def test_non_loopback_without_keys_is_refused(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "pagedllm.cli", "serve", "--host", "0.0.0.0",
                           "--port", str(free_port())], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "--api-key-file" in proc.stderr and "refusing" in proc.stderr


def test_bad_key_file_is_refused_at_start(tmp_path):
    keys = tmp_path / "keys.txt"
    keys.write_text("alice short\n")
    proc = subprocess.run([sys.executable, "-m", "pagedllm.cli", "serve", "--api-key-file",
                           str(keys), "--port", str(free_port())], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2 and "line 1" in proc.stderr and "short" not in proc.stderr.split("line 1")[0]


ROUTES = [("GET", "/v1/models", None),
          ("POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 1}),
          ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}),
          ("POST", "/tokenize", {"prompt": "Hi"}),
          ("POST", "/detokenize", {"tokens": [1, 2]}),
          ("GET", "/metrics", None)]


@pytest.mark.parametrize("method,path,body", ROUTES)
def test_every_route_needs_the_right_key(keyed, method, path, body):
    url = keyed.url + path
    missing = httpx.request(method, url, json=body)
    wrong = httpx.request(method, url, json=body, headers={"Authorization": "Bearer nope-nope-nope"})
    right = httpx.request(method, url, json=body, headers=auth("alice"), timeout=60)
    assert missing.status_code == 401 and wrong.status_code == 401
    assert missing.json()["error"]["code"] == "invalid_api_key"
    assert set(wrong.json()["error"]) == {"message", "type", "param", "code"}
    assert KEYS["alice"] not in wrong.text
    assert right.status_code == 200


def test_health_stays_open(keyed):
    assert httpx.get(keyed.url + "/health").status_code == 200


def _non_loopback_address() -> str | None:
    import ipaddress

    import psutil

    for addresses in psutil.net_if_addrs().values():
        for address in addresses:
            if address.family.name == "AF_INET" and not ipaddress.ip_address(address.address).is_loopback:
                return address.address
    return None


def test_health_tells_key_reloads_to_this_machine_only(keyed):
    """`pagedllm keys` reads a reload's result back from /health; other machines see only
    the status (an error names the key file's path)."""
    local = httpx.get(keyed.url + "/health").json()
    assert local["status"] == "ok"
    assert set(local["api_keys"]) == {"reloads", "error", "keys"} and local["api_keys"]["keys"] >= 3
    other = _non_loopback_address()
    if other is None:
        pytest.skip("this machine has no address but loopback")
    remote = httpx.get(f"http://{other}:{keyed.port}/health").json()
    assert remote == {"status": "ok"}


def test_keys_are_never_logged(keyed):
    complete(keyed, "alice")
    assert all(k not in keyed.output() for k in KEYS.values())


def test_cors_only_for_allowed_origins(keyed):
    preflight = {"Origin": "http://app.example", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}
    ok = httpx.options(keyed.url + "/v1/completions", headers=preflight)
    assert ok.headers.get("access-control-allow-origin") == "http://app.example"
    evil = httpx.options(keyed.url + "/v1/completions", headers={**preflight, "Origin": "http://evil.example"})
    assert "access-control-allow-origin" not in evil.headers


def test_tokens_per_minute_are_enforced_while_answers_run(keyed):
    """Four concurrent 150-token requests against 200 tokens a minute: the running one's
    reservation (prompt + max_tokens) counts at once, so only one runs; a chat request
    without max_tokens then gets what the key has left and ends with "length"."""
    def one(i):
        return complete(keyed, "metered", prompt=f"Item {i}:", max_tokens=150, ignore_eos=True)

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        responses = list(pool.map(one, range(4)))
    assert sorted(r.status_code for r in responses) == [200, 429, 429, 429]
    used = sum(r.json()["usage"]["total_tokens"] for r in responses if r.status_code == 200)
    assert used <= 200
    for r in responses:
        if r.status_code == 429:
            assert 1 <= int(r.headers["Retry-After"]) <= 60
            assert r.json()["error"]["code"] == "rate_limit_exceeded"
    chat = httpx.post(keyed.url + "/v1/chat/completions", headers=auth("metered"), timeout=120,
                      json={"messages": [{"role": "user", "content": "Hi"}], "ignore_eos": True})
    assert chat.status_code == 200, chat.text
    assert chat.json()["choices"][0]["finish_reason"] == "length"
    assert used + chat.json()["usage"]["total_tokens"] <= 200
    assert complete(keyed, "metered", max_tokens=2).status_code == 429
    assert complete(keyed, "alice").status_code == 200  # others are unaffected


def test_x_api_key_header_is_accepted(keyed):
    body = {"prompt": "Hello", "max_tokens": 2}
    ok = httpx.post(keyed.url + "/v1/completions", headers={"x-api-key": KEYS["alice"]}, json=body,
                    timeout=120)
    assert ok.status_code == 200
    bad = httpx.post(keyed.url + "/v1/completions", headers={"x-api-key": "wrong-key-0123456"},
                     json=body, timeout=120)
    assert bad.status_code == 401 and bad.json()["error"]["code"] == "invalid_api_key"


def test_docs_render_from_the_servers_own_assets(keyed):
    """/docs needs no network: its script and style come from this server (no key needed for
    the page, the schema or the assets; the API itself still needs one)."""
    import re

    page = httpx.get(keyed.url + "/docs", timeout=30)
    assert page.status_code == 200 and "SwaggerUIBundle" in page.text
    assets = re.findall(r"""(?:src|href)=["']([^"']+)["']""", page.text)
    assert assets and not [a for a in assets if "://" in a], assets  # nothing from elsewhere
    for asset in assets:
        got = httpx.get(keyed.url + asset, timeout=30)
        assert got.status_code == 200 and len(got.content) > 1000, asset
    schema = httpx.get(keyed.url + "/openapi.json", timeout=30)
    assert schema.status_code == 200 and schema.json()["openapi"].startswith("3.")
    # The key schemes Swagger UI's Authorize button offers (a bearer token or x-api-key).
    schemes = schema.json()["components"]["securitySchemes"]
    assert schemes["bearer"]["scheme"] == "bearer" and schemes["x-api-key"]["in"] == "header"
    assert {"bearer": []} in schema.json()["security"]
    assert httpx.get(keyed.url + "/v1/models", timeout=30).status_code == 401


def test_ready_line_and_quiet_access_log(keyed):
    for _ in range(3):
        httpx.get(keyed.url + "/health", timeout=30)
    complete(keyed, "alice")
    log = keyed.output()
    assert "listening on every interface (0.0.0.0)" in log and "the page at http://" in log
    assert f":{keyed.port}/v1, Anthropic and Ollama http://" in log  # base URLs as clients take them
    assert "API keys: on, 3 key(s)" in log and "compute thread(s)" in log
    assert "POST /v1/completions" in log
    assert "GET /health" not in log  # polls stay out of the access log at info


def test_prefix_cache_is_isolated_between_keys(keyed):
    body = dict(prompt=LONG_PROMPT, max_tokens=2)
    complete(keyed, "alice", **body)
    again = complete(keyed, "alice", **body).json()
    other = complete(keyed, "bob", **body).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= 100
    assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def gauge(server, name: str) -> float:
    text = httpx.get(server.url + "/metrics", headers=auth("alice"), verify=False).text
    line = next(l for l in text.splitlines() if l.startswith(f"pagedllm:{name}{{"))
    return float(line.split()[-1])


def waiting_requests(server) -> float:
    return gauge(server, "num_requests_waiting")


def test_fair_share_between_keys(keyed):
    """alice floods 40 requests, then bob sends 2 while most of alice's still wait: both of
    bob's finish within a few of alice's completions (FCFS would put them after all 40)."""
    finished = []
    lock = threading.Lock()

    def run(key, tag):
        r = complete(keyed, key, prompt=f"Request {tag}: count to ten.", max_tokens=12, ignore_eos=True)
        assert r.status_code == 200, r.text
        with lock:
            finished.append(tag)

    with concurrent.futures.ThreadPoolExecutor(42) as pool:
        futures = [pool.submit(run, "alice", f"a{i}") for i in range(40)]
        # Event-driven, not a fixed sleep: bob comes once alice's flood is queued.
        deadline = time.monotonic() + 60
        while waiting_requests(keyed) < 25 and time.monotonic() < deadline:
            time.sleep(0.02)
        with lock:
            alice_done_before_bob = len(finished)
        futures += [pool.submit(run, "bob", f"b{i}") for i in range(2)]
        for f in futures:
            f.result()
    assert alice_done_before_bob <= 15  # most of alice's flood was still waiting
    alice_order = [t for t in finished if t.startswith("a")]
    # Two slots: bob takes the next two that free up, so at most ~4 more of alice's finish first.
    limit = alice_order[alice_done_before_bob + 6]
    assert finished.index("b0") < finished.index(limit)
    assert finished.index("b1") < finished.index(limit)
    text = httpx.get(keyed.url + "/metrics", headers=auth("alice")).text
    assert 'pagedllm:user_requests_total{user="bob"}' in text
    assert 'pagedllm:user_completion_tokens_total{user="alice"}' in text


def test_queue_position_is_reported_while_waiting(keyed):
    """Both slots are taken by long requests (400 tokens: seconds) before bob comes, checked
    on the running gauge rather than by a sleep: bob is told his place in the queue."""
    blockers = [threading.Thread(target=complete, args=(keyed, "alice"),
                                 kwargs={"max_tokens": 400, "ignore_eos": True}) for _ in range(2)]
    for t in blockers:
        t.start()
    deadline = time.monotonic() + 60
    while gauge(keyed, "num_requests_running") < 2:
        assert time.monotonic() < deadline, "the blockers are not running"
        time.sleep(0.02)
    events = []
    body = {"prompt": "Hi", "max_tokens": 2, "stream": True, "queue_position": True}
    with httpx.stream("POST", keyed.url + "/v1/completions", json=body, headers=auth("bob"),
                      timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    for t in blockers:
        t.join()
    positions = [e for e in events if e["object"] == "queue.position"]
    assert positions and positions[0]["queue_position"] >= 1 and positions[0]["choices"] == []
    assert events[-1]["choices"][0]["finish_reason"] == "length"


def test_sighup_reloads_keys_without_restart(keyed):
    assert complete(keyed, "alice").status_code == 200
    carol = "carol-key-0123456789"
    keyed.keys_path.write_text(f"bob {KEYS['bob']}\ncarol {carol}\nmetered {KEYS['metered']}\n")
    keyed.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 10
    while complete(keyed, "alice").status_code != 401:
        assert time.monotonic() < deadline, "alice's key still accepted"
        time.sleep(0.2)
    r = httpx.post(keyed.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 1},
                   headers={"Authorization": f"Bearer {carol}"}, timeout=60)
    assert r.status_code == 200
    assert keyed.proc.poll() is None


@pytest.fixture(scope="module")
def bounded(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bounded")
    keys = folder / "keys.txt"
    write_keys(keys)
    args = ["--api-key-file", str(keys), "--kv-cache-memory", str(256 << 20), "--max-num-seqs",
            "1", "--max-queue", "2", "--shared-prefix-cache", "--max-tokens-limit", "8000",
            "--max-prompt-tokens", "1000", "--request-timeout", "300"]
    scheme = "http"
    if shutil.which("openssl"):
        subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                        "-subj", "/CN=127.0.0.1", "-keyout", str(folder / "key.pem"),
                        "-out", str(folder / "cert.pem")], check=True, capture_output=True)
        args += ["--ssl-certfile", str(folder / "cert.pem"), "--ssl-keyfile", str(folder / "key.pem")]
        scheme = "https"
    proc = ServerProcess(*args, log_path=str(folder / "log"), wait_ready=False)
    proc.url = proc.url.replace("http", scheme, 1)
    deadline = time.monotonic() + 120
    while True:
        try:
            if httpx.get(proc.url + "/health", verify=False, timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            assert time.monotonic() < deadline and proc.proc.poll() is None, proc.output()
            time.sleep(0.3)
    yield proc
    proc.stop()


def post_bounded(server, key, **body):
    return httpx.post(server.url + "/v1/completions", headers=auth(key), verify=False, timeout=120,
                      json={"prompt": "Hello", "max_tokens": 4, "temperature": 0, **body})


def test_tls_serves_https(bounded):
    if not bounded.url.startswith("https"):
        pytest.skip("openssl not available")
    assert httpx.get(bounded.url + "/health", verify=False).status_code == 200


def test_queue_full_is_429_and_accepted_requests_complete(bounded):
    """One slot, a queue of 2: while a 150-token request holds the slot (checked on the
    running gauge, not assumed from timing), 12 more get at most 2 places."""
    def one(i):
        return post_bounded(bounded, "alice" if i % 2 else "bob", prompt=f"Item {i}:",
                            max_tokens=20, ignore_eos=True)

    with concurrent.futures.ThreadPoolExecutor(13) as pool:
        blocker = pool.submit(post_bounded, bounded, "alice", prompt="Go on:", max_tokens=150,
                              ignore_eos=True)
        deadline = time.monotonic() + 60
        while gauge(bounded, "num_requests_running") < 1:
            assert time.monotonic() < deadline and not blocker.done(), "the blocker is not running"
            time.sleep(0.01)
        responses = list(pool.map(one, range(12)))
        assert blocker.result().json()["usage"]["completion_tokens"] == 150
    codes = [r.status_code for r in responses]
    assert 429 in codes and 200 in codes and set(codes) <= {200, 429}
    for r in responses:
        if r.status_code == 429:
            assert r.headers["Retry-After"] and r.json()["error"]["code"] == "queue_full"
        else:
            assert r.json()["usage"]["completion_tokens"] == 20  # nothing accepted is lost


def test_shared_prefix_cache_across_keys(bounded):
    post_bounded(bounded, "alice", prompt=LONG_PROMPT, max_tokens=2)
    other = post_bounded(bounded, "bob", prompt=LONG_PROMPT, max_tokens=2).json()
    assert other["usage"]["prompt_tokens_details"]["cached_tokens"] >= 100


def test_request_limits(bounded):
    r = post_bounded(bounded, "alice", max_tokens=8001)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    r = post_bounded(bounded, "alice", prompt=[5] * 1001)
    assert r.status_code == 400 and r.json()["error"]["code"] == "prompt_too_long"


@pytest.fixture(scope="module")
def timed(tmp_path_factory):
    """A server whose requests may run 3 s: no CPU makes 7,900 tokens in that (0.4 ms a
    token), however fast or idle. The other servers' timeouts are long, so a loaded CI host
    never cuts their requests short."""
    proc = ServerProcess("--kv-cache-memory", str(256 << 20), "--max-num-seqs", "1",
                         "--request-timeout", "3", "--served-model-name", "smollm2",
                         log_path=str(tmp_path_factory.mktemp("timed") / "log"))
    yield proc
    proc.stop()


def test_request_timeout_aborts(timed):
    r = httpx.post(timed.url + "/v1/completions", timeout=300, json={
        "prompt": "Write forever:", "max_tokens": 7900, "ignore_eos": True, "temperature": 0})
    assert r.status_code == 200
    choice = r.json()["choices"][0]
    # OpenAI's clients know no "abort": cut short is "length", with the reason beside it.
    assert choice["finish_reason"] == "length"
    assert "request timeout of 3 s" in choice["error"]["message"]
    assert r.json()["usage"]["completion_tokens"] < 7900
