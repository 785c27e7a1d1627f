"""`pagedllm serve --replicas 2` on a local Ray cluster on loopback, with the real default
model, driven by the official openai client: both replicas serve, a conversation's next turn
finds its prefix where it was computed, keys and limits hold across replicas, a client that
leaves aborts its request on its replica, and a replica killed mid-stream ends that stream
with an error while the other one serves on (and Ray brings the dead one back)."""
from __future__ import annotations

import os
import re
import signal
import threading
import time
import uuid

import httpx
import openai
import pytest

pytest.importorskip("ray.serve", reason="Ray Serve is the optional extra pagedllm[ray]")

from server_process import ServerProcess  # noqa: E402

from probes import wait_for

pytestmark = pytest.mark.slow
KEYS = {"alice": "alice-key-0123456789", "capped": "capped-key-0123456789",
        "metered": "metered-key-0123456789"}
MODEL = "SmolLM2-135M-Instruct.Q4_1"


def write_keys(path, extra=""):
    path.write_text(f"alice {KEYS['alice']}\n"
                    f"capped {KEYS['capped']} max_concurrent=1\n"
                    f"metered {KEYS['metered']} tokens_per_minute=300\n" + extra)
    os.chmod(path, 0o600)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    folder = tmp_path_factory.mktemp("replicas")
    keys = folder / "keys.txt"
    write_keys(keys)
    # Without the AMX tiles: on them a prompt's tail prefilled after a prefix-cache hit (1-2
    # rows: the AVX-512 kernel) is summed in another order than the whole prompt (3+ rows: the
    # tiles), and the greedy answers below are compared across that (docs/cpu-levels.md).
    server = ServerProcess("--replicas", "2", "--kv-cache-memory", "64MiB", "--max-num-seqs", "2",
                           "--max-queue", "1", "--api-key-file", str(keys),
                           log_path=str(folder / "serve.log"), wait_ready=False,
                           env={"PAGEDLLM_CPU_AMX": "0"})
    server.keys_path = keys
    try:
        server.wait_ready(timeout=240)
        wait_for(lambda: len(replica_rows(server, "num_kv_blocks")) == 2, 60)
        yield server
    finally:
        server.stop()


def client(server, key="alice", **kwargs) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEYS.get(key, key), max_retries=0,
                         **kwargs)


def replica_rows(server, name: str) -> dict[str, float]:
    """One metric's value per replica, from the ingress's /metrics."""
    text = httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {KEYS['alice']}"},
                     timeout=10).text
    rows = {}
    for line in text.splitlines():
        if line.startswith(f"pagedllm:{name}{{"):
            replica = re.search(r'replica="([^"]+)"', line).group(1)
            rows[replica] = float(line.rsplit(" ", 1)[1])
    return rows


def replica_pids(server) -> dict[str, int]:
    text = httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {KEYS['alice']}"},
                     timeout=10).text
    return {m.group(2): int(m.group(1)) for m in re.finditer(
        r'pagedllm:replica_info\{[^}]*pid="(\d+)"[^}]*replica="([^"]+)"', text)}


def chat(server, messages, key="alice", **extra):
    return client(server, key).chat.completions.create(model=MODEL, messages=messages,
                                                       temperature=0, **extra)


def test_each_replica_says_where_it_runs(cluster):
    """replica_info names each replica's Ray node and host; the ready line says where they
    run. Each reserves its threads as Ray CPUs (placement.py), so on this 2-CPU machine the
    two 1-thread replicas fill it."""
    text = httpx.get(cluster.url + "/metrics", headers={"Authorization": f"Bearer {KEYS['alice']}"},
                     timeout=10).text
    rows = re.findall(r'pagedllm:replica_info\{([^}]*)\}', text)
    assert len(rows) == 2
    for labels in rows:
        assert re.search(r'node="[0-9a-f]{16,}"', labels) and re.search(r'host="[^"]+"', labels)
    # The ready line comes once both replicas have posted (the ingress answers before).
    wait_for(lambda: re.search(r"replicas: 2 on \S+ \(node [0-9a-f]{8}\)", cluster.output()), 120)


def test_the_live_view_shows_each_replica(cluster):
    """/v1/server/state with replicas: every replica listed (host, pool, load), the first's
    blocks and requests by default, another's with ?replica=, an unknown one a 404; all from
    the figures the replicas post, not calls into their engines."""
    headers = {"Authorization": f"Bearer {KEYS['alice']}"}
    url = cluster.url + "/v1/server/state"
    data = wait_for(lambda: (r := httpx.get(url, headers=headers, timeout=10)).status_code == 200
                    and r.json(), 30)
    listed = [r["replica"] for r in data["replicas"]]
    assert len(listed) == 2 and data["replica"] == listed[0]
    assert all(r["host"] and r["kv_blocks_total"] > 0 for r in data["replicas"])
    assert len(data["blocks"]) == data["replicas"][0]["kv_blocks_total"]
    second = httpx.get(url, params={"replica": listed[1]}, headers=headers, timeout=10).json()
    assert second["replica"] == listed[1] and len(second["blocks"]) == data["replicas"][1]["kv_blocks_total"]
    unknown = httpx.get(url, params={"replica": "nope"}, headers=headers, timeout=10)
    assert unknown.status_code == 404 and listed[0] in unknown.json()["error"]["message"]


def test_the_page_picks_a_replica(cluster):
    """In chromium: the picker lists both replicas; picking the second shows its blocks."""
    import shutil

    chromium = shutil.which("chromium") or "/usr/bin/chromium"
    if not os.path.exists(chromium):
        pytest.skip("Debian's chromium is not installed")
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.add_init_script(f"sessionStorage.setItem('pagedllm-api-key', '{KEYS['alice']}')")
            page.goto(cluster.url + "/#server")
            page.wait_for_function("document.querySelectorAll('#replica-select option').length === 2",
                                   timeout=60_000)
            assert page.is_visible("#replica-picker")
            second = page.eval_on_selector_all("#replica-select option", "os => os[1].value")
            page.select_option("#replica-select", second)
            page.wait_for_function(f"window.pagedllm.liveState.latest.replica === '{second}'",
                                   timeout=30_000)
            assert "blocks of" in page.inner_text("#pool-summary")
        finally:
            browser.close()


def test_openai_client_streamed_and_not(cluster):
    messages = [{"role": "user", "content": "Name three colours."}]
    whole = chat(cluster, messages, max_tokens=12)
    assert whole.choices[0].message.content and whole.usage.completion_tokens > 0
    stream = chat(cluster, messages, max_tokens=12, stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert streamed == whole.choices[0].message.content  # greedy: same answer either way


def test_a_key_is_checked(cluster):
    with pytest.raises(openai.AuthenticationError):
        chat(cluster, [{"role": "user", "content": "hi"}], key="wrong-key", max_tokens=2)
    assert httpx.get(cluster.url + "/v1/models").status_code == 401


def test_requests_land_on_both_replicas(cluster):
    """Requests with no prefix in common go to the less loaded of two random replicas (the
    router's fallback), so a round of six can land all on one (1 in 32): up to four rounds,
    each request answered or refused with a 429 (--max-queue 1), never lost."""
    before = replica_rows(cluster, "prompt_tokens_total")

    def both_grew():
        after = replica_rows(cluster, "prompt_tokens_total")
        return len(after) == 2 and all(after[r] > before.get(r, 0) for r in after)

    for _round in range(4):
        # Plain completions with unique openings: no prefix in common, so the router balances
        # (chat prompts of one user share the template's opening blocks, and would stick).
        prompts = [f"{uuid.uuid4().hex} is a code; the number {i} is" for i in range(6)]
        outcomes: list = []

        def send(prompt):
            try:
                outcomes.append(client(cluster).completions.create(
                    model=MODEL, prompt=prompt, max_tokens=8).choices[0].finish_reason)
            except openai.RateLimitError:
                outcomes.append(429)

        threads = [threading.Thread(target=send, args=(p,)) for p in prompts]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(outcomes) == 6 and set(outcomes) <= {"length", "stop", 429}, outcomes
        try:
            wait_for(both_grew, 5)
            return
        except AssertionError:
            continue
    raise AssertionError(f"four rounds of six all landed on one replica: {replica_rows(cluster, 'prompt_tokens_total')}")


def test_next_turn_finds_its_prefix_on_the_replica_that_served_the_first(cluster):
    for conversation in range(3):
        system = f"Conversation {uuid.uuid4().hex}. You are a careful assistant. " * 12
        messages = [{"role": "system", "content": system},
                    {"role": "user", "content": "Say hello."}]
        first = chat(cluster, messages, max_tokens=8)
        messages += [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "user", "content": "And once more."}]
        second = chat(cluster, messages, max_tokens=8)
        cached = second.usage.prompt_tokens_details.cached_tokens
        # Every full block of the first turn's prompt (16 tokens a block) is found again.
        assert cached >= first.usage.prompt_tokens - 16, (conversation, cached)


def test_token_rate_is_global(cluster):
    first = chat(cluster, [{"role": "user", "content": "Count to ten."}], key="metered",
                 max_tokens=200)
    assert first.usage.total_tokens > 0
    with pytest.raises(openai.RateLimitError) as refused:
        chat(cluster, [{"role": "user", "content": "Count to ten."}], key="metered",
             max_tokens=200)
    assert refused.value.response.headers.get("retry-after")


def test_concurrency_cap_holds_across_replicas(cluster):
    """capped has max_concurrent=1: its second request starts only after the first ends,
    though the other replica is idle."""
    events = []

    def run(tag):
        stream = chat(cluster, [{"role": "user", "content": f"Tell a story {tag}"}],
                      key="capped", max_tokens=24, stream=True,
                      extra_body={"ignore_eos": True})
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                events.append(("token", tag))
        events.append(("end", tag))

    threads = [threading.Thread(target=run, args=(tag,)) for tag in "ab"]
    for t in threads:
        t.start()
        time.sleep(0.2)
    for t in threads:
        t.join()
    first_end = next(i for i, e in enumerate(events) if e[0] == "end")
    finished = events[first_end][1]
    other = "b" if finished == "a" else "a"
    assert all(tag != other for kind, tag in events[:first_end]), events


def test_full_queues_get_429_with_retry_after(cluster):
    """2 replicas x (2 running + 1 waiting) = 6 in flight; the 7th is refused."""
    stop = threading.Event()
    opened = []

    def hold(i):
        with httpx.stream("POST", cluster.url + "/v1/completions",
                          headers={"Authorization": f"Bearer {KEYS['alice']}"}, timeout=120,
                          json={"prompt": f"Story {i}:", "max_tokens": 400, "ignore_eos": True,
                                "stream": True}) as response:
            opened.append(response.status_code)
            for _ in response.iter_lines():
                if stop.is_set():
                    return

    threads = [threading.Thread(target=hold, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    try:
        wait_for(lambda: len(opened) == 6, 60)
        refused = httpx.post(cluster.url + "/v1/completions",
                             headers={"Authorization": f"Bearer {KEYS['alice']}"},
                             json={"prompt": "one more", "max_tokens": 4}, timeout=30)
        assert refused.status_code == 429, refused.text
        assert refused.headers.get("retry-after")
        assert refused.json()["error"]["code"]
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert opened == [200] * 6
    # The streams that went away were aborted on their replicas: nothing runs any more.
    wait_for(lambda: sum(replica_rows(cluster, "num_requests_running").values()) == 0, 30)


def test_sighup_reloads_keys_in_the_ingress(cluster):
    write_keys(cluster.keys_path, "carol carol-key-0123456789\n")
    cluster.proc.send_signal(signal.SIGHUP)
    KEYS["carol"] = "carol-key-0123456789"
    wait_for(lambda: httpx.get(cluster.url + "/v1/models", timeout=5, headers={
        "Authorization": "Bearer carol-key-0123456789"}).status_code == 200, 20)


def test_a_replica_killed_mid_stream_ends_that_stream_with_an_error(cluster):
    """Last in this module: it kills a replica (Ray then starts a new one)."""
    before = replica_pids(cluster)
    assert len(before) == 2
    # Streams abandoned by earlier tests must be gone first, or the victim could be wrong.
    wait_for(lambda: sum(replica_rows(cluster, "num_requests_running").values()) == 0, 30)
    stream = chat(cluster, [{"role": "user", "content": f"A long story {uuid.uuid4().hex}"}],
                  max_tokens=1500, stream=True, extra_body={"ignore_eos": True})
    chunks = iter(stream)
    for _ in range(3):
        next(chunks)
    def only_ours():  # the figures lag up to a second: wait until ours is the one running
        rows = replica_rows(cluster, "num_requests_running")
        return [r for r, n in rows.items() if n > 0] if sum(rows.values()) == 1 else None
    running = wait_for(only_ours, 20)
    victim = before[running[0]]
    os.kill(victim, signal.SIGKILL)
    with pytest.raises(openai.APIError) as ended:
        for _ in chunks:
            pass
    assert "replica" in str(ended.value)
    # New requests go to the living replica meanwhile.
    for i in range(3):
        answer = chat(cluster, [{"role": "user", "content": f"Quick {i}"}], max_tokens=4)
        assert answer.choices[0].message.content is not None
    # Ray brings a replacement up (a new process).
    wait_for(lambda: len(replica_pids(cluster)) == 2 and victim not in replica_pids(cluster).values(),
             180, every=1)
