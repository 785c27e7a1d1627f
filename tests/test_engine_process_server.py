"""`pagedllm serve --engine-process` on the default model, through the official SDKs: the same
answers as the one-process server, and an engine process killed mid-stream ends that stream
with a finish_reason and an error, /health says why while it restarts, and the next request is answered."""
import time

import httpx
import psutil
import pytest

from pagedllm.serving.engine_process import PROCESS_NAME
from server_process import ServerProcess

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engine_server(tmp_path_factory):
    log = tmp_path_factory.mktemp("engine_process") / "server.log"
    proc = ServerProcess("--engine-process", "--dtype", "float32", "--kv-cache-memory",
                         str(512 << 20), "--max-num-seqs", "16", "--served-model-name", "smollm2",
                         log_path=str(log))
    yield proc
    proc.stop()
    assert _engines(proc) == []  # the engine process goes with the server


def _engines(proc: ServerProcess) -> list[psutil.Process]:
    try:
        children = psutil.Process(proc.proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return [p for p in psutil.process_iter(["name"]) if p.info["name"] == PROCESS_NAME
                and p.ppid() == proc.proc.pid]
    return [p for p in children if p.name() == PROCESS_NAME and p.status() != psutil.STATUS_ZOMBIE]


def _openai(proc):
    from openai import OpenAI

    return OpenAI(base_url=proc.url + "/v1", api_key="unused", max_retries=0, timeout=600)


PROMPTS = ["The capital of France is", "def fibonacci(n):", "1, 2, 3, 4,"]


def test_answers_equal_the_one_process_servers(engine_server, server):
    for prompt in PROMPTS:
        answers = []
        for proc in (server, engine_server):
            chunks = _openai(proc).completions.create(
                model="smollm2", prompt=prompt, max_tokens=24, temperature=0, stream=True,
                logprobs=2, stop=[" 7", "\n\n"])
            texts, finish = [], None
            for chunk in chunks:
                texts.append(chunk.choices[0].text)
                finish = chunk.choices[0].finish_reason or finish
            answers.append(("".join(texts), finish))
        assert answers[1] == answers[0]
    chats = [_openai(proc).chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Name a colour."}], max_tokens=16,
        temperature=0.8, seed=7) for proc in (server, engine_server)]
    assert chats[1].choices[0].message.content == chats[0].choices[0].message.content


def test_the_anthropic_and_ollama_clients(engine_server):
    import anthropic
    import ollama

    message = anthropic.Anthropic(base_url=engine_server.url, api_key="unused").messages.create(
        model="smollm2", max_tokens=8, messages=[{"role": "user", "content": "Hi"}])
    assert message.usage.output_tokens >= 1 and message.stop_reason in ("end_turn", "max_tokens")
    reply = ollama.Client(host=engine_server.url).generate(
        model="smollm2", prompt="1, 2, 3,", options={"num_predict": 5, "temperature": 0})
    assert reply.eval_count >= 1


def test_metrics_and_the_live_state_come_from_the_engine_process(engine_server):
    _openai(engine_server).completions.create(model="smollm2", prompt="Hello", max_tokens=4)
    metrics = httpx.get(engine_server.url + "/metrics").text
    generated = [line for line in metrics.splitlines()
                 if line.startswith("pagedllm:generation_tokens_total")]
    assert generated and float(generated[0].split()[-1]) >= 4
    state = httpx.get(engine_server.url + "/v1/server/state").json()
    assert state["block_size"] == 16 and set(state["blocks"]) <= {"0", "1", "2", "3"}


def test_a_killed_engine_process_ends_its_stream_and_the_server_restarts_it(engine_server):
    from openai import APIError

    [engine] = _engines(engine_server)
    stream = _openai(engine_server).completions.create(
        model="smollm2", prompt="Once upon a time", max_tokens=1000, temperature=0, stream=True,
        extra_body={"ignore_eos": True})
    chunks = []
    with pytest.raises(APIError, match="killed by SIGKILL"):
        for i, chunk in enumerate(stream):
            chunks.append(chunk)
            if i == 3:
                engine.kill()
    # the stream's own end came first: a finish_reason, and an error naming why
    [last] = chunks[-1].choices
    assert last.finish_reason == "length"
    assert "killed by SIGKILL" in last.model_extra["error"]["message"]
    seen_restarting = None
    for _ in range(1200):  # the new engine loads the model again (seconds; minutes if busy)
        health = httpx.get(engine_server.url + "/health")
        if health.status_code == 200:
            break
        seen_restarting = health.json()["error"]
        time.sleep(0.1)
    assert health.status_code == 200
    if seen_restarting is not None:  # a quick restart may go unseen between two polls
        assert seen_restarting["code"] == "engine_restarting"
        assert "killed by SIGKILL" in seen_restarting["message"]
    [new_engine] = _engines(engine_server)
    assert new_engine.pid != engine.pid
    answer = _openai(engine_server).completions.create(model="smollm2", prompt="Hi",
                                                       max_tokens=3, temperature=0)
    assert answer.usage.completion_tokens == 3
    assert "engine process restarted" in engine_server.output()


def test_a_request_while_it_restarts_gets_503_naming_why(tmp_path):
    """A slow load (a test hook) holds the restart open long enough to be asked."""
    proc = ServerProcess("--engine-process", "--kv-cache-memory", str(256 << 20),
                         log_path=str(tmp_path / "server.log"),
                         env={"PAGEDLLM_TEST_LOAD_DELAY": "3"})
    try:
        [engine] = _engines(proc)
        engine.kill()
        for _ in range(600):
            answer = httpx.post(proc.url + "/v1/completions",
                                json={"prompt": "Hi", "max_tokens": 2})
            if answer.status_code == 503:
                break
            time.sleep(0.05)
        assert answer.status_code == 503
        assert answer.headers["retry-after"] == "2"
        assert answer.json()["error"]["code"] == "engine_restarting"
        proc.wait_ready()  # and it comes back
    finally:
        assert proc.stop() == 0


def test_an_engine_whose_steps_keep_failing_is_restarted_not_fatal(tmp_path):
    proc = ServerProcess("--engine-process", "--kv-cache-memory", str(256 << 20),
                         log_path=str(tmp_path / "server.log"),
                         env={"PAGEDLLM_TEST_BREAK_ENGINE": "1"})
    try:
        for _ in range(3):  # three failed steps in a row: that engine gives up
            answer = httpx.post(proc.url + "/v1/completions",
                                json={"prompt": "Hi", "max_tokens": 2}, timeout=600)
            assert answer.status_code in (500, 503)
            proc.wait_ready()
        for _ in range(600):
            if "steps failed in a row" in proc.output():
                break
            time.sleep(0.1)
        assert "3 engine steps failed in a row" in proc.output()
        assert proc.proc.poll() is None  # the server itself goes on
        proc.wait_ready()
    finally:
        assert proc.stop() == 0


def test_the_engine_process_ends_when_its_server_is_killed(tmp_path):
    """A front end killed outright (no drain, no Stop message) leaves no engine behind, even
    one busy with a long answer, and no socket folder (the engine removes it as it goes)."""
    import os
    import threading

    proc = ServerProcess("--engine-process", "--kv-cache-memory", str(256 << 20),
                         log_path=str(tmp_path / "server.log"))
    [engine] = _engines(proc)
    front = psutil.Process(proc.proc.pid)  # the sockets are bound (named) on its side
    [folder] = {os.path.dirname(c.laddr) for c in front.net_connections("unix")
                if "pagedllm-engine-" in c.laddr}
    assert os.path.basename(folder).startswith("pagedllm-engine-") and os.path.isdir(folder)
    started = threading.Event()

    def stream():
        try:
            body = {"prompt": "Once", "max_tokens": 4000, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", proc.url + "/v1/completions", json=body,
                              timeout=60) as answer:
                for _ in answer.iter_lines():
                    started.set()
        except httpx.HTTPError:
            pass
    reader = threading.Thread(target=stream, daemon=True)
    reader.start()
    assert started.wait(300)
    proc.proc.kill()
    proc.proc.wait()
    gone, alive = psutil.wait_procs([engine], timeout=120)
    assert alive == [] and gone
    assert not os.path.exists(folder)
    proc.stop()
