"""Server process lifecycle: SIGTERM drains then aborts; the chat and generate commands."""
import json
import signal
import subprocess
import sys
import threading

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
        for t in threads:
            t.join(60)
        assert server.proc.wait(60) == 0
        # The short request finished normally within the grace period.
        assert short_events[-1] == "[DONE]"
        assert json.loads(short_events[-2])["choices"][0]["finish_reason"] == "length"
        # The long one got a final chunk saying it was aborted, then [DONE].
        assert long_events[-1] == "[DONE]"
        assert json.loads(long_events[-2])["choices"][0]["finish_reason"] == "abort"
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
