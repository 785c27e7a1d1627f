"""The team's page, driven in a real headless browser (Playwright with Debian's chromium)
against a real server: chat streamed, stop, the live block map with shared blocks, the key
prompt, model output shown as text; and the state endpoint and routes over plain HTTP."""
from __future__ import annotations

import re
import json
import os
import shutil
import threading
import time

import httpx
import pytest

from server_process import ServerProcess

from probes import metric

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
KEY = "page-key-0123456789"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("page")
    proc = ServerProcess("--kv-cache-memory", str(48 << 20), "--max-num-seqs", "4",
                         "--dtype", "float32", log_path=str(folder / "log"))
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    folder = tmp_path_factory.mktemp("page-keyed")
    keys = folder / "keys.txt"
    keys.write_text(f"alice {KEY}\n")
    keys.chmod(0o600)
    proc = ServerProcess("--kv-cache-memory", str(32 << 20), "--api-key-file", str(keys),
                         log_path=str(folder / "log"))
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def browser():
    if not os.path.exists(CHROMIUM):
        pytest.skip("Debian's chromium is not installed (make test installs it with apt-get; "
                    "this host could not)")
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as playwright:
        # --no-sandbox: the tests run as root, where chromium's sandbox refuses to start.
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield browser
        browser.close()


@pytest.fixture
def page(browser):
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    errors = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    yield page
    context.close()
    assert not errors, errors


def open_page(page, url):
    page.goto(url)
    page.wait_for_selector("body[data-ready=true]", timeout=30_000)


def set_max_tokens(page, value: int) -> None:
    page.evaluate("document.getElementById('chat-settings').open = true")
    page.fill("#max-tokens", str(value))


def test_chat_streams_an_answer_with_its_figures(server, page):
    open_page(page, server.url)
    set_max_tokens(page, 12)
    page.fill("#prompt", "What is the capital of France?")
    page.press("#prompt", "Enter")
    answer = page.locator(".message.assistant").last
    answer.locator(".meta span", has_text="TTFT").wait_for(timeout=60_000)
    assert answer.locator(".body").inner_text().strip()
    meta = answer.locator(".meta span").inner_text()
    assert "tok/s" in meta and "prompt tokens cached" in meta
    # Kept in the browser: a reload shows the conversation again.
    open_page(page, server.url)
    assert page.locator(".message.user").first.inner_text() == "What is the capital of France?"


def test_stop_aborts_the_request_on_the_server(server, page):
    open_page(page, server.url)
    set_max_tokens(page, 900)  # the pool holds ~1,090 tokens: the context here
    page.fill("#prompt", "Write a very long story about a lighthouse keeper.")
    page.click("#send")
    deadline = time.monotonic() + 60
    while metric(server, "num_requests_running") < 1:
        assert time.monotonic() < deadline, "the request never ran"
        time.sleep(0.05)
    page.click("#stop")
    deadline = time.monotonic() + 20
    while metric(server, "num_requests_running") > 0:
        assert time.monotonic() < deadline, "the server still runs the stopped request"
        time.sleep(0.05)
    page.locator(".message.assistant .meta span", has_text="stopped").wait_for(timeout=10_000)


def test_block_map_marks_shared_blocks_and_agrees_with_metrics(server, page):
    """n=3 samples of one long prompt share its blocks; the map marks them while they run."""
    body = {"prompt": "The quick brown fox jumps over the lazy dog. " * 30, "n": 3,
            "max_tokens": 400, "ignore_eos": True, "temperature": 1.0, "seed": 1, "stream": True}
    done = threading.Event()

    def run():  # streamed, so leaving early (done) aborts the samples: no waiting them out
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=300) as r:
            for _ in r.iter_lines():
                if done.is_set():
                    return

    thread = threading.Thread(target=run)
    thread.start()
    try:
        page.goto(server.url + "/#server")
        page.wait_for_selector("body[data-ready=true]", timeout=30_000)
        page.wait_for_function("Number(document.getElementById('block-map').dataset.shared) > 0",
                               timeout=60_000)
        latest = page.evaluate("window.pagedllm.liveState.latest")
        shared = [i for i, state in enumerate(latest["blocks"]) if state == "3"]
        assert shared and all(len(latest["block_refs"][str(i)]) == 3 for i in shared)
        used_cells = int(page.eval_on_selector("#block-map", "c => c.dataset.used"))
        assert used_cells == latest["stats"]["kv_blocks_used"]
        usage = metric(server, "kv_cache_usage_perc")
        assert abs(usage - used_cells / len(latest["blocks"])) < 0.1  # a few steps apart
        summary = page.inner_text("#pool-summary")
        assert f"{len(latest['blocks'])} blocks" in summary and "shared" in summary
        assert page.locator("#requests tbody tr").count() >= 3
        assert "KV cache" in page.inner_text("#config")
        assert page.locator("#plan tbody tr").count() == 7
        # Hovering a shared cell names its owners.
        box = page.locator("#block-map").bounding_box()
        columns = int(page.eval_on_selector("#block-map", "c => c.dataset.columns"))
        cell = box["width"] / columns
        page.mouse.move(box["x"] + (shared[0] % columns + 0.5) * cell,
                        box["y"] + (shared[0] // columns + 0.5) * cell)
        tip = page.inner_text("#block-tip")
        assert f"block {shared[0]}" in tip and "owners" in tip
    finally:
        done.set()
        thread.join(300)


def test_server_view_fits_its_columns_flags_costs_and_draws_axes(server, browser):
    """At 1400 px no table of the server view is cut (the Requests table has the page's
    width); a cost row larger than the pool says so and is marked; the charts have a y axis
    with round labels and an x axis ending at "now"."""
    context = browser.new_context(viewport={"width": 1400, "height": 900})
    page = context.new_page()
    try:
        page.goto(server.url + "/#server")
        page.wait_for_selector("body[data-ready=true]", timeout=30_000)
        page.wait_for_function("window.pagedllm.liveState.snapshots > 3", timeout=60_000)
        for table in ("requests", "fair-share", "plan", "bench"):
            clipped = page.evaluate("""id => {
                const card = document.getElementById(id).closest('.card');
                return card.offsetParent === null ? 0 : card.scrollWidth - card.clientWidth; }""", table)
            assert clipped <= 0, f"#{table} is cut by {clipped} px"
        plan = httpx.get(server.url + "/v1/server/state?config=true", timeout=30).json()["plan"]
        over = [row["parallel"] for row in plan if not row["full_context_fits"]]
        assert over, "a 48 MiB pool holds 64 requests at full context?"
        cells = page.locator("#plan tbody tr td:nth-child(2)")
        for i, row in enumerate(plan):
            text, marked = cells.nth(i).inner_text(), "over" in (cells.nth(i).get_attribute("class") or "")
            assert ("more than this pool" in text) == marked == (not row["full_context_fits"])
        # The chart's left margin holds the y labels, its bottom row the x labels.
        inked = page.evaluate("""() => {
            const c = document.getElementById('chart-kv'), ctx = c.getContext('2d');
            const ink = (x, y, w, h) => ctx.getImageData(x, y, w, h).data.some((v, i) => i % 4 === 3 && v > 0);
            return {left: ink(0, 14, 34, c.height - 30), bottom: ink(0, c.height - 12, c.width, 12)}; }""")
        assert inked == {"left": True, "bottom": True}
        assert page.evaluate("""async () => {
            const {niceCeiling} = await import('/ui/charts.js');
            return [niceCeiling(0), niceCeiling(0.7), niceCeiling(3), niceCeiling(42), niceCeiling(100),
                    niceCeiling(240)]; }""") == [1, 1, 5, 50, 100, 250]
    finally:
        context.close()


def test_model_output_is_shown_as_text_never_run(server, page):
    hostile = "<script>window.hacked = 1</script><img src=x onerror=\"window.hacked = 2\"> **bold**"
    open_page(page, server.url)  # ready first: its own start writes the conversation list
    page.evaluate("""text => localStorage.setItem('pagedllm-conversations', JSON.stringify([
        {id: 'x', title: 't', messages: [{role: 'user', content: 'hi'},
                                         {role: 'assistant', content: text, meta: ''}]}]))""",
                  hostile)
    open_page(page, server.url)
    body = page.locator(".message.assistant .body").last
    assert "<script>window.hacked = 1</script>" in body.inner_text()
    assert body.locator("script, img").count() == 0 and body.locator("strong").inner_text() == "bold"
    assert page.evaluate("window.hacked") is None


def test_streamed_model_output_with_markup_stays_text(server, page):
    """The real model, constrained by a grammar to answer with markup, streamed into the
    page: the page's request gets a guided_choice added on its way out (the page itself
    sends none), so what arrives is genuine model output through the same render path."""
    hostile = "<script>window.hacked = 1</script><b onmouseover=alert(1)>x</b>"

    def add_choice(route):
        body = json.loads(route.request.post_data)
        route.continue_(post_data=json.dumps({**body, "guided_choice": [hostile]}))

    page.route("**/v1/chat/completions", add_choice)
    open_page(page, server.url)
    page.fill("#prompt", "Say something.")
    page.press("#prompt", "Enter")
    answer = page.locator(".message.assistant").last
    answer.locator(".meta span", has_text="TTFT").wait_for(timeout=60_000)
    assert answer.locator(".body").inner_text().strip() == hostile
    assert answer.locator(".body script, .body b").count() == 0
    assert page.evaluate("window.hacked") is None


def test_bench_results_are_shown(tmp_path, browser):
    """--bench-results DIR: the newest bench.json there appears in the server view."""
    results = tmp_path / "bench-results" / "run1"
    results.mkdir(parents=True)
    (results / "bench.json").write_text(json.dumps({
        "settings": {}, "recommendation": {"concurrency": 4, "reason": "highest N meeting targets"},
        "levels": [{"concurrency": n, "output_tokens_per_s": 10.0 * n, "ttft_ms": {"p95": 100.0 * n},
                    "tpot_ms": {"p95": 20.0}, "meets_slo": n <= 4} for n in (1, 2, 4, 8)]}))
    proc = ServerProcess("--kv-cache-memory", str(32 << 20), "--bench-results",
                         str(tmp_path / "bench-results"), log_path=str(tmp_path / "log"))
    try:
        data = httpx.get(proc.url + "/v1/server/state?config=true", timeout=30).json()
        assert data["bench"]["recommendation"]["concurrency"] == 4
        context = browser.new_context()
        page = context.new_page()
        page.goto(proc.url + "/#server")
        page.wait_for_selector("#bench-card:not([hidden])", timeout=30_000)
        assert "recommended N = 4" in page.inner_text("#bench-summary")
        assert page.locator("#bench tbody tr").count() == 4
        context.close()
    finally:
        proc.stop()


def test_keyed_server_asks_for_a_key_and_refuses_a_wrong_one(keyed, page):
    page.goto(keyed.url)
    page.wait_for_selector("#key-dialog[open]", timeout=30_000)
    page.fill("#key-input", "wrong-key-0123456")
    page.click("#key-form button")
    page.wait_for_selector("#key-error:not([hidden])", timeout=30_000)
    assert "refused" in page.inner_text("#key-error")
    page.fill("#key-input", KEY)
    page.click("#key-form button")
    page.wait_for_selector("body[data-ready=true]", timeout=30_000)
    assert page.evaluate("sessionStorage.getItem('pagedllm-api-key')") == KEY
    page.click("button[data-view=server]")
    page.wait_for_function("window.pagedllm.liveState.snapshots > 1", timeout=30_000)


# -- plain HTTP -------------------------------------------------------------------------------

def test_state_endpoint(server):
    data = httpx.get(server.url + "/v1/server/state?config=true", timeout=30).json()
    assert set(data["blocks"]) <= set("0123") and len(data["blocks"]) == data["stats"]["kv_blocks_total"]
    assert data["config"]["block_size"] == data["block_size"] and data["config"]["cpu_isa"]
    assert [row["parallel"] for row in data["plan"]] == [1, 2, 4, 8, 16, 32, 64]
    # float32 SmolLM2: 2 x 30 layers x 3 KV heads x 64 x 4 bytes a token, whole blocks.
    context = data["config"]["max_model_len"]
    assert data["plan"][1]["full_context_bytes"] == 2 * -(-context // 16) * 16 * 46080
    assert set(data["latency"]) == {"ttft_ms", "tpot_ms"} and data["memory"]["rss_bytes"] > 0
    assert data["bench"] is None  # no --bench-results


def test_state_stream_is_paced_and_bounded(server):
    """At most one snapshot every 0.5 s, made only as the client reads: a reader that stalls
    for 3 s finds a few snapshots waiting, not a backlog."""
    with httpx.stream("GET", server.url + "/v1/server/state?stream=true", timeout=30) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        time.sleep(3)
        started, count = time.monotonic(), 0
        for line in response.iter_lines():
            if line.startswith("data: "):
                json.loads(line[6:])
                count += 1
                if time.monotonic() - started > 2.0:
                    break
        elapsed = time.monotonic() - started + 3
    assert 3 <= count <= elapsed / 0.5 + 2


def test_routes_under_root_are_not_the_page(server, keyed):
    assert httpx.get(server.url + "/", timeout=30).headers["content-type"].startswith("text/html")
    for path in ("/nope", "/ui/nope.js", "/ui/../server/app.py", "/index.html"):
        r = httpx.get(server.url + path, timeout=30)
        assert r.status_code == 404 and "error" in r.json(), path
    assert httpx.get(keyed.url + "/", timeout=30).status_code == 200  # the page is open
    assert httpx.get(keyed.url + "/ui/app.js", timeout=30).status_code == 200
    refused = httpx.get(keyed.url + "/v1/server/state", timeout=30)
    assert refused.status_code == 401
    ok = httpx.get(keyed.url + "/v1/server/state", headers={"Authorization": f"Bearer {KEY}"},
                   timeout=30)
    assert ok.status_code == 200


def test_the_live_view_shows_speculation_when_a_request_asked_for_it(server, page):
    """A request may ask for n-gram proposals on a server that does not default to them; the
    page's pool line then shows how many were accepted."""
    body = {"prompt": "one two three four five six seven eight. one two three four five six",
            "max_tokens": 24, "temperature": 0, "speculative": "ngram"}
    assert httpx.post(server.url + "/v1/completions", json=body, timeout=120).status_code == 200
    page.goto(server.url + "/#server")
    page.wait_for_selector("body[data-ready=true]", timeout=30_000)
    page.wait_for_function("document.getElementById('cache-stats').textContent.includes('speculative')",
                           timeout=60_000)
    text = page.inner_text("#cache-stats")
    assert "proposed tokens accepted" in text and "tokens a verification" in text


def test_a_store_picks_its_model_and_shows_what_is_loaded(tmp_path, tiny_llama_folder, browser):
    """A model store's page: the chat's picker lists every model, a message to one loads it;
    the server view lists the store (loaded or not) and picks among the loaded models."""
    from pagedllm.weights import default_model_path

    models = tmp_path / "models"
    models.mkdir()
    os.symlink(default_model_path(), models / "smollm2.gguf")
    os.symlink(tiny_llama_folder, models / "tiny-hf")
    proc = ServerProcess("--models-dir", str(models), "--kv-cache-memory", "64MiB",
                         log_path=str(tmp_path / "server.log"))
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    errors = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    try:
        open_page(page, proc.url + "/#server")
        page.locator("#config", has_text="No model is loaded yet").wait_for(timeout=30_000)
        page.locator("#models tbody tr", has_text="not loaded").first.wait_for(timeout=30_000)
        open_page(page, proc.url)
        options = page.eval_on_selector_all("#chat-model option", "els => els.map(e => e.value)")
        assert options == ["smollm2", "tiny-hf"]
        page.evaluate("document.getElementById('chat-settings').open = true")
        page.select_option("#chat-model", "tiny-hf")
        set_max_tokens(page, 4)
        page.fill("#prompt", "Hello")
        page.press("#prompt", "Enter")
        answer = page.locator(".message.assistant").last
        # The end of the answer, not its TTFT: four sampled tokens of the tiny random model
        # may decode to no text at all (byte pieces, EOS), and then no TTFT is shown.
        meta = answer.locator(".meta span", has_text=re.compile("finished|error"))
        meta.wait_for(timeout=120_000)
        assert "finished" in meta.inner_text(), meta.inner_text()
        ps = httpx.get(proc.url + "/api/ps", timeout=30).json()["models"]
        assert [m["name"] for m in ps] == ["tiny-hf:latest"]  # the picked one, only
        page.click(".tab[data-view=server]")
        page.locator("#models tbody tr", has_text="tiny-hf").filter(
            has_not_text="not loaded").first.wait_for(timeout=30_000)
        assert page.locator("#replica-label").inner_text() == "Model"
        assert page.locator("#replica-select option").first.inner_text().startswith("tiny-hf")
        assert "tiny-hf" in page.locator("#config").inner_text()
    finally:
        context.close()
        proc.stop()
    assert not errors, errors
