"""`pagedllm serve` refuses a bad start in one line, before loading anything: a model path
that does not exist, a folder that is no checkpoint, a port another program holds."""
import socket
import subprocess
import sys

import pytest


def serve(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pagedllm.cli", "serve", *argv],
                          capture_output=True, text=True, timeout=300)


def one_error_line(done: subprocess.CompletedProcess) -> str:
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2, done.stderr
    assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr
    return lines[0]


@pytest.fixture()
def port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_missing_model_is_one_line_with_where_to_get_one(port):
    line = one_error_line(serve("--model", "/no/such/model.gguf", "--port", str(port)))
    assert "/no/such/model.gguf" in line and "no such file" in line
    assert "GGUF" in line and "config.json" in line and "bundled" in line


def test_a_folder_that_is_no_checkpoint_is_one_line(tmp_path, port):
    line = one_error_line(serve("--model", str(tmp_path), "--port", str(port)))
    assert "config.json" in line and str(tmp_path) in line


def test_a_busy_port_is_said_before_the_model_loads():
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        busy = holder.getsockname()[1]
        line = one_error_line(serve("--port", str(busy)))
    assert f"127.0.0.1:{busy}" in line and "--port" in line


def test_while_the_model_loads_the_port_answers_503_loading(tmp_path):
    """Between start and ready, /health says "loading" (503, Retry-After) and an API call gets
    a 503 in its API's shape; once ready, /health is 200. The load waits at the fault seam's
    gate until the test has seen the loading phase, whatever the host's speed."""
    import time

    import httpx
    from server_process import ServerProcess

    gate = tmp_path / "gate"
    server = ServerProcess("--dtype", "float32", log_path=str(tmp_path / "log"),
                           env={"PAGEDLLM_TEST_LOAD_GATE": str(gate)}, wait_ready=False)
    try:
        health = None
        deadline = time.monotonic() + 120
        while health is None and time.monotonic() < deadline:
            try:
                answer = httpx.get(server.url + "/health", timeout=5)
                health = answer if answer.status_code == 503 else None
            except httpx.HTTPError:
                time.sleep(0.2)
        assert health is not None, server.output()
        assert health.json() == {"status": "loading"} and health.headers["retry-after"]
        api = httpx.post(server.url + "/v1/chat/completions", json={}, timeout=5)
        assert api.status_code == 503 and api.json()["error"]["code"] == "loading"
        ollama = httpx.post(server.url + "/api/chat", json={}, timeout=5)
        assert ollama.status_code == 503 and "loading" in ollama.json()["error"]
        assert httpx.get(server.url + "/health", timeout=5).status_code == 503  # still held
        gate.touch()
        server.wait_ready(timeout=240)
        assert httpx.get(server.url + "/health", timeout=30).status_code == 200
    finally:
        server.stop()


def test_the_engine_process_is_refused_with_a_store_or_replicas(tmp_path, port):
    for extra in (["--models-dir", str(tmp_path)], ["--replicas", "2"]):
        line = one_error_line(serve("--engine-process", "--port", str(port), *extra))
        assert "--engine-process serves one model" in line
