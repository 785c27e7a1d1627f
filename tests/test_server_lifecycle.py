"""Server process lifecycle: SIGTERM drains then aborts; the chat and generate commands."""
import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx

from server_process import ServerProcess


def stream_events(url, body, events, started):
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                started.set()


def test_sigterm_lets_short_requests_finish_aborts_long_ones_and_exits_0(tmp_path):
    server = ServerProcess("--kv-cache-memory", str(256 << 20), "--shutdown-grace", "3",
                           log_path=str(tmp_path / "log"))
    try:
        long_events, short_events = [], []
        long_started, short_started = threading.Event(), threading.Event()
        long_body = {"prompt": "Tell me everything.", "max_tokens": 4000, "ignore_eos": True,
                     "temperature": 0, "stream": True}
        short_body = {"prompt": "Hello", "max_tokens": 20, "ignore_eos": True, "stream": True}
        threads = [threading.Thread(target=stream_events, args=(server.url, long_body, long_events, long_started)),
                   threading.Thread(target=stream_events, args=(server.url, short_body, short_events, short_started))]
        threads[0].start()
        assert long_started.wait(60)
        threads[1].start()
        assert short_started.wait(60)
        server.proc.send_signal(signal.SIGTERM)
        # Draining: still listening, so a load balancer hears 503 from /health (and new
        # work is refused) while the running requests go on.
        deadline = time.monotonic() + 2  # the signal reaches the main thread between ops
        while (health := httpx.get(server.url + "/health", timeout=5)).status_code == 200:
            assert time.monotonic() < deadline, "still healthy after SIGTERM"
            time.sleep(0.02)
        assert health.status_code == 503 and health.json()["error"]["code"] == "shutting_down"
        refused = httpx.post(server.url + "/v1/completions", json={"prompt": "Hi"}, timeout=5)
        assert refused.status_code == 503
        for t in threads:
            t.join(60)
        assert server.proc.wait(60) == 0
        # The short request finished normally within the grace period.
        assert short_events[-1] == "[DONE]"
        assert json.loads(short_events[-2])["choices"][0]["finish_reason"] == "length"
        # The long one got a final chunk saying it was cut short and why, then [DONE].
        assert long_events[-1] == "[DONE]"
        last = json.loads(long_events[-2])["choices"][0]
        assert last["finish_reason"] == "length"
        assert "shutting down" in last["error"]["message"]
        assert "API keys: off (loopback only" in server.output()
        # Nobody is listening any more.
        try:
            httpx.get(server.url + "/health", timeout=2)
            raise AssertionError("server still answering")
        except httpx.HTTPError:
            pass
    finally:
        server.stop()


def test_chat_command_against_a_server(server):
    proc = subprocess.run([sys.executable, "-m", "pagedllm.cli", "chat", "--url", server.url,
                           "--temperature", "0", "--max-tokens", "20"],
                          input="What is the capital of France?\n/exit\n", capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout
    # The banner names the model and the server.
    banner = proc.stdout.splitlines()[0]
    assert banner.startswith("pagedllm chat with ") and banner.endswith(f" at {server.url}")


def test_chat_against_a_keyed_server_without_a_key_fails_at_once(tmp_path):
    keys = tmp_path / "keys.txt"
    keys.write_text("alice alice-key-0123456789\n")
    keys.chmod(0o600)
    server = ServerProcess("--api-key-file", str(keys), "--kv-cache-memory", str(64 << 20),
                           log_path=str(tmp_path / "log"))
    try:
        env = {k: v for k, v in os.environ.items() if k != "PAGEDLLM_API_KEY"}
        done = subprocess.run([sys.executable, "-m", "pagedllm.cli", "chat", "--url", server.url],
                              input="", capture_output=True, text=True, timeout=60, env=env)
        assert done.returncode == 2 and "needs an API key" in done.stderr
        wrong = subprocess.run([sys.executable, "-m", "pagedllm.cli", "chat", "--url", server.url,
                                "--api-key", "nope-nope-nope"], input="", capture_output=True,
                               text=True, timeout=60)
        assert wrong.returncode == 2 and "refused the API key" in wrong.stderr
        ok = subprocess.run([sys.executable, "-m", "pagedllm.cli", "chat", "--url", server.url,
                             "--api-key", "alice-key-0123456789"], input="/exit\n",
                            capture_output=True, text=True, timeout=60)
        assert ok.returncode == 0 and server.url in ok.stdout
    finally:
        server.stop()


def test_chat_loop_reset_and_interrupt():
    from pagedllm.tools.chat import chat_loop

    seen = []

    def stream(messages):
        seen.append([m["content"] for m in messages])
        yield "part"
        if messages[-1]["content"] == "long":
            raise KeyboardInterrupt

    inputs = iter(["hi", "long", "next", "/reset", "fresh", "/exit"])
    out = []
    assert chat_loop(stream, "sys", read=lambda _: next(inputs), write=out.append, banner="m at u") == 0
    assert out[0] == "pagedllm chat with m at u\n"
    # The interrupted answer (and its question) are not sent again; /reset keeps the system.
    assert seen == [["sys", "hi"], ["sys", "hi", "part", "long"], ["sys", "hi", "part", "next"],
                    ["sys", "fresh"]]
    assert any("interrupted" in o for o in out)
    assert any("conversation cleared, system prompt kept" in o for o in out)


def test_chat_loop_keeps_history_and_reports_errors():
    from pagedllm.tools.chat import chat_loop

    seen = []

    def stream(messages):
        seen.append([m["content"] for m in messages])
        if messages[-1]["content"] == "boom":
            raise RuntimeError("server answered 400")
        yield "ok"

    inputs = iter(["hi", "boom", "again", "/exit"])
    out = []
    assert chat_loop(stream, "sys", read=lambda _: next(inputs), write=out.append) == 0
    assert seen == [["sys", "hi"], ["sys", "hi", "ok", "boom"], ["sys", "hi", "ok", "again"]]
    assert any("error: server answered 400" in o for o in out)


def test_generate_command():
    proc = subprocess.run([sys.executable, "-m", "pagedllm.cli", "generate", "The capital of France is",
                           "--max-tokens", "4", "--kv-cache-memory", str(64 << 20)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout


def test_chat_has_line_editing_and_keeps_history(tmp_path):
    """`pagedllm chat` reads lines through readline (arrows, editing, up for earlier
    questions), its questions kept in a history file across sessions."""
    import readline

    from pagedllm.tools.chat import line_editing

    path = tmp_path / "sub" / "history"
    readline.clear_history()
    save = line_editing(str(path))
    readline.add_history("what is paged attention?")
    save()  # what leaving the chat does (registered with atexit)
    assert path.read_text().strip().endswith("what is paged attention?")
    readline.clear_history()
    assert line_editing(str(path)) is not None
    assert readline.get_history_item(readline.get_current_history_length()) == \
        "what is paged attention?"
