"""A model store behind one real server (serve --models-dir): the bundled GGUF and a Hugging
Face folder made here, listed without loading, loaded on first request, answering in turn
and at once through the official openai and ollama clients; the budget unloading the idle
model and never a busy one (503 + Retry-After meanwhile); keep_alive 0 unloading after the
answer; an unknown model answered with the names of the known ones."""
from __future__ import annotations

import concurrent.futures
import os

import httpx
import pytest

from pagedllm.embeddings.packaged import packaged_folder
from pagedllm.weights import default_model_path
from server_process import ServerProcess, free_port

from probes import metric, wait_for

HI = [{"role": "user", "content": "Say hello."}]


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory, tiny_llama_folder):
    folder = tmp_path_factory.mktemp("models")
    os.symlink(default_model_path(), folder / "smollm2.gguf")
    os.symlink(tiny_llama_folder, folder / "tiny-hf")
    os.symlink(packaged_folder(), folder / "minilm")  # a sentence-transformers folder
    return str(folder)


def start(models_dir, tmp_path_factory, *extra) -> ServerProcess:
    log = tmp_path_factory.mktemp("store") / "server.log"
    return ServerProcess("--models-dir", models_dir, "--kv-cache-memory", "64MiB",
                         "--max-num-seqs", "4", *extra, log_path=str(log))


@pytest.fixture(scope="module")
def store(models_dir, tmp_path_factory):
    proc = start(models_dir, tmp_path_factory)
    yield proc
    proc.stop()


def loaded(proc) -> list[str]:
    answer = httpx.get(proc.url + "/api/ps", timeout=30)
    assert answer.status_code == 200 and "models" in answer.json(), (answer.status_code,
                                                                    answer.text)
    return sorted(m["name"] for m in answer.json()["models"])


def test_every_model_is_listed_before_any_loads(store):
    assert loaded(store) == [] and metric(store, "models_loaded", missing=0.0) == 0
    models = {m["id"]: m for m in httpx.get(store.url + "/v1/models", timeout=30).json()["data"]}
    assert set(models) == {"smollm2", "tiny-hf", "minilm"}
    assert models["minilm"]["kind"] == "embedding" and models["minilm"]["architecture"] == "bert"
    assert models["minilm"]["parameters"] > 20e6 and "kind" not in models["smollm2"]
    assert models["smollm2"]["architecture"] == "llama" and models["smollm2"]["quantization"] == "Q4_1"
    assert models["smollm2"]["parameters"] > 100e6 and models["smollm2"]["context_length"] == 8192
    assert models["tiny-hf"]["quantization"] == "none" and models["tiny-hf"]["context_length"] == 512
    assert not any(m["loaded"] for m in models.values())
    tags = httpx.get(store.url + "/api/tags", timeout=30).json()["models"]
    assert sorted(t["name"] for t in tags) == ["minilm:latest", "smollm2:latest", "tiny-hf:latest"]
    assert {t["details"]["format"] for t in tags} == {"gguf", "safetensors"}


def test_two_models_answer_in_turn_and_at_once(store):
    from openai import OpenAI

    client = OpenAI(base_url=store.url + "/v1", api_key="none")
    for name in ("smollm2", "tiny-hf"):
        answer = client.chat.completions.create(model=name, messages=HI, max_tokens=8,
                                                temperature=0)
        assert answer.model == name and answer.usage.completion_tokens >= 1
    assert loaded(store) == ["smollm2:latest", "tiny-hf:latest"]
    assert metric(store, "model_loads_total", model_name="smollm2", missing=0.0) == 1

    def ask(name):
        return client.chat.completions.create(model=name, messages=HI, max_tokens=16,
                                              temperature=0, extra_body={"ignore_eos": True})

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(ask, ["smollm2", "tiny-hf", "smollm2", "tiny-hf"]))
    assert [a.model for a in answers] == ["smollm2", "tiny-hf", "smollm2", "tiny-hf"]
    assert all(a.usage.completion_tokens == 16 for a in answers)
    assert answers[0].choices[0].message.content == answers[2].choices[0].message.content
    # Each model's engine is counted under its own name; nothing was loaded twice.
    assert metric(store, "generation_tokens_total", model_name="tiny-hf", missing=0.0) >= 32
    assert metric(store, "model_loads_total", model_name="tiny-hf", missing=0.0) == 1


def test_an_unknown_model_is_answered_with_the_known_ones(store):
    from openai import NotFoundError, OpenAI

    client = OpenAI(base_url=store.url + "/v1", api_key="none")
    with pytest.raises(NotFoundError) as caught:
        client.chat.completions.create(model="llama3", messages=HI)
    assert "`smollm2`" in str(caught.value) and "`tiny-hf`" in str(caught.value)
    missing = httpx.post(store.url + "/v1/chat/completions", json={"messages": HI}, timeout=30)
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "model"
    ollama = httpx.post(store.url + "/api/chat", json={"model": "llama3", "messages": HI},
                        timeout=30)
    assert ollama.status_code == 404 and "tiny-hf" in ollama.json()["error"]
    bad_keep = httpx.post(store.url + "/api/chat", json={"model": "tiny-hf", "messages": HI,
                                                         "keep_alive": "soon"}, timeout=30)
    assert bad_keep.status_code == 400 and "keep_alive" in bad_keep.json()["error"]


def test_keep_alive_zero_unloads_after_the_answer(store):
    import ollama

    client = ollama.Client(host=store.url)
    # The other model loaded here, not by an earlier test (this one runs alone too).
    client.chat(model="smollm2", messages=HI, keep_alive="1h", options={"num_predict": 1})
    answer = client.chat(model="tiny-hf", messages=HI, keep_alive=0, options={"num_predict": 4})
    assert answer.message.content is not None
    wait_for(lambda: "tiny-hf:latest" not in loaded(store), what="tiny-hf unloaded")
    assert metric(store, "model_unloads_total", model_name="tiny-hf", reason="expired", missing=0.0) >= 1
    assert "smollm2:latest" in loaded(store)  # the other model's keep-alive has not run out
    # Ollama's "load" request (no prompt) loads it again; keep_alive -1 keeps it for good.
    load = httpx.post(store.url + "/api/generate", json={"model": "tiny-hf", "keep_alive": -1},
                      timeout=120).json()
    assert load["done_reason"] == "load"
    ps = {m["name"]: m for m in httpx.get(store.url + "/api/ps", timeout=30).json()["models"]}
    assert ps["tiny-hf:latest"]["expires_at"].startswith("2318")
    assert ps["tiny-hf:latest"]["size"] > 64 << 20  # weights + its 64 MiB KV cache
    unload = httpx.post(store.url + "/api/generate", json={"model": "tiny-hf", "keep_alive": 0},
                        timeout=120).json()
    assert unload["done_reason"] == "unload"
    wait_for(lambda: "tiny-hf:latest" not in loaded(store), what="tiny-hf unloaded again")


def test_the_budget_unloads_the_idle_model_and_never_a_busy_one(models_dir, tmp_path_factory):
    proc = start(models_dir, tmp_path_factory, "--max-loaded-models", "1")
    try:
        chat = lambda name, **extra: httpx.post(  # noqa: E731
            proc.url + "/v1/chat/completions", timeout=120,
            json={"model": name, "messages": HI, "max_tokens": 4, **extra})
        assert chat("tiny-hf").status_code == 200
        assert chat("smollm2").status_code == 200  # tiny-hf was idle: unloaded for it
        assert loaded(proc) == ["smollm2:latest"]
        assert metric(proc, "model_unloads_total", model_name="tiny-hf", reason="room", missing=0.0) == 1
        body = {"model": "smollm2", "messages": HI, "max_tokens": 2000, "ignore_eos": True,
                "stream": True}
        with httpx.stream("POST", proc.url + "/v1/chat/completions", json=body,
                          timeout=120) as streaming:
            assert streaming.status_code == 200
            lines = streaming.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))  # it runs
            refused = chat("tiny-hf")
            assert refused.status_code == 503 and refused.headers["retry-after"]
            assert refused.json()["error"]["code"] == "model_busy"
            assert "smollm2 is busy" in refused.json()["error"]["message"]
            assert loaded(proc) == ["smollm2:latest"]  # the busy model stayed
            # Streamed with queue positions, the refusal comes in-band after the loading chunk.
            lines = httpx.post(proc.url + "/v1/chat/completions", timeout=120, json={
                "model": "tiny-hf", "messages": HI, "stream": True,
                "queue_position": True}).text.splitlines()
            chunks = [line for line in lines if line.startswith("data: {")]
            assert '"loading": true' in chunks[0] and '"model_busy"' in chunks[-1]
            assert lines[-1] == "data: [DONE]" or lines[-2] == "data: [DONE]"
        # Its client went away: the request is aborted, the model idle, and room is made.
        wait_for(lambda: chat("tiny-hf").status_code == 200, what="tiny-hf served after the stream")
        assert loaded(proc) == ["tiny-hf:latest"]
        assert metric(proc, "model_busy_refusals_total", missing=0.0) >= 1
    finally:
        proc.stop()


def test_serve_refuses_a_bad_store_before_loading(tmp_path):
    import subprocess
    import sys

    def serve(*args):
        return subprocess.run([sys.executable, "-m", "pagedllm.cli", "serve", "--port",
                               str(free_port()), *args], capture_output=True, text=True,
                              timeout=120)

    missing = serve("--models-dir", str(tmp_path / "nope"))
    assert missing.returncode == 2 and "no such folder" in missing.stderr
    empty = serve("--models-dir", str(tmp_path))
    assert empty.returncode == 2 and "store is empty" in empty.stderr
    (tmp_path / "m.gguf").symlink_to(default_model_path())
    alias = serve("--models-dir", str(tmp_path), "--model-alias", "gpt-4o")
    assert alias.returncode == 2 and "aliases" in alias.stderr
    keep = serve("--models-dir", str(tmp_path), "--keep-alive", "a while")
    assert keep.returncode == 2 and "keep_alive" in keep.stderr


def test_the_queue_bound_counts_every_models_waiting_requests(models_dir, tmp_path_factory):
    """--max-queue is the server's: a request waiting for one model fills it for another."""
    log = tmp_path_factory.mktemp("store-queue") / "server.log"
    proc = ServerProcess("--models-dir", models_dir, "--kv-cache-memory", "64MiB",
                         "--max-num-seqs", "1", "--max-queue", "1", log_path=str(log))
    body = {"model": "smollm2", "messages": HI, "max_tokens": 2000, "ignore_eos": True,
            "stream": True}
    try:
        assert httpx.post(proc.url + "/api/generate", json={"model": "tiny-hf"},
                          timeout=120).status_code == 200  # loaded, idle
        with httpx.stream("POST", proc.url + "/v1/chat/completions", json=body,
                          timeout=120) as running, \
                httpx.stream("POST", proc.url + "/v1/chat/completions", json=body,
                             timeout=120) as waiting:
            assert running.status_code == waiting.status_code == 200
            wait_for(lambda: metric(proc, "num_requests_waiting", model_name="smollm2", missing=0.0) == 1,
                     what="the second smollm2 request waits")
            full = httpx.post(proc.url + "/v1/chat/completions", timeout=120,
                              json={"model": "tiny-hf", "messages": HI, "max_tokens": 4})
            assert full.status_code == 429 and full.json()["error"]["code"] == "queue_full"
        wait_for(lambda: httpx.post(proc.url + "/v1/chat/completions", timeout=120, json={
            "model": "tiny-hf", "messages": HI, "max_tokens": 4}).status_code == 200,
            what="room in the queue once the streams ended")
    finally:
        proc.stop()


def test_an_embedding_model_in_the_store_loads_on_demand(store):
    """A sentence-transformers folder in the store: loaded by its first embeddings request,
    kept by keep_alive like a chat model, refused where text is to be generated."""
    import numpy as np
    import ollama
    from openai import BadRequestError, OpenAI

    from pagedllm.embeddings.sentence_model import SentenceModel

    client = OpenAI(base_url=store.url + "/v1", api_key="none")
    texts = ["The cat sits on the mat.", "Quarterly revenue grew."]
    answer = client.embeddings.create(model="minilm", input=texts)
    vectors = np.array([d.embedding for d in answer.data])
    exact = SentenceModel(packaged_folder(), dtype="float32")
    expected = exact.embed(exact.tokenize(texts)).numpy()
    assert vectors.shape == (2, 384) and (vectors * expected).sum(1).min() >= 0.9999
    assert "minilm:latest" in loaded(store)
    assert metric(store, "model_loads_total", model_name="minilm", missing=0.0) == 1
    with pytest.raises(BadRequestError, match="makes embeddings"):
        client.chat.completions.create(model="minilm", messages=HI)
    with pytest.raises(BadRequestError, match="does not make embeddings"):
        client.embeddings.create(model="smollm2", input="x")
    show = httpx.post(store.url + "/api/show", json={"model": "minilm"}, timeout=60).json()
    assert show["capabilities"] == ["embedding"] and show["model_info"]["embedding_length"] == 384
    embedded = ollama.Client(host=store.url).embed(model="minilm", input=texts[0], keep_alive=0)
    assert np.allclose(embedded.embeddings[0], vectors[0], atol=1e-5)
    wait_for(lambda: "minilm:latest" not in loaded(store), what="minilm unloaded after keep_alive 0")


def test_a_stream_says_its_model_is_loading_while_others_serve(models_dir, tmp_path_factory):
    """queue_position: true to a model not loaded yet: the stream starts at once with
    loading chunks (OpenAI's client skips them: they hold no choices), then the answer; a
    model already loaded answers meanwhile."""
    import json
    import threading

    from openai import OpenAI

    log = tmp_path_factory.mktemp("store-loading") / "server.log"
    proc = ServerProcess("--models-dir", models_dir, "--kv-cache-memory", "64MiB",
                         log_path=str(log), env={"PAGEDLLM_TEST_LOAD_DELAY": "6"})
    try:
        client = OpenAI(base_url=proc.url + "/v1", api_key="none", timeout=120)
        # Loaded first (slowly: the delay applies to every load), so it can answer below.
        client.chat.completions.create(model="tiny-hf", messages=HI, max_tokens=2)
        seen = {"loading": 0, "content": False}
        first_loading = threading.Event()

        def read():
            body = {"model": "smollm2", "messages": HI, "max_tokens": 4, "stream": True,
                    "queue_position": True}
            with httpx.stream("POST", proc.url + "/v1/chat/completions", json=body,
                              timeout=120) as streaming:
                for line in streaming.iter_lines():
                    if not line.startswith("data: {"):
                        continue
                    chunk = json.loads(line[6:])
                    if chunk.get("loading"):
                        seen["loading"] += 1
                        first_loading.set()
                    elif chunk.get("choices"):
                        seen["content"] = True

        reader = threading.Thread(target=read)
        reader.start()
        assert first_loading.wait(60), "no loading chunk"
        # The loaded model answers while the other loads (no ordering asserted: that would
        # depend on the machine's speed).
        meanwhile = client.chat.completions.create(model="tiny-hf", messages=HI, max_tokens=2)
        assert meanwhile.usage.completion_tokens >= 1
        reader.join(120)
        assert seen["loading"] >= 2 and seen["content"]
        # The OpenAI client reads the same stream as plain chunks.
        httpx.post(proc.url + "/api/generate", json={"model": "tiny-hf", "keep_alive": 0})
        wait_for(lambda: "tiny-hf:latest" not in loaded(proc), what="tiny-hf unloaded")
        # (A random-weight model's tokens may decode to no text: count tokens, not text.)
        chunks = list(client.chat.completions.create(
            model="tiny-hf", messages=HI, max_tokens=3, stream=True,
            stream_options={"include_usage": True}, extra_body={"queue_position": True}))
        assert chunks[-1].usage.completion_tokens >= 1
        assert any(c.choices and c.choices[0].finish_reason for c in chunks)
    finally:
        proc.stop()


def test_config_file_models_with_their_own_options_and_aliases(models_dir, tmp_path):
    """[models] entries alone make a store: names, aliases, per-model engine options and a
    model's own chat template."""
    config = tmp_path / "pagedllm.toml"
    config.write_text(f'''kv-cache-memory = "64MiB"
[models.small]
path = "{models_dir}/smollm2.gguf"
max-model-len = 1024
aliases = ["gpt-4o-mini"]
[models.hf]
path = "{models_dir}/tiny-hf"
dtype = "float32"
chat-template = "{{% for m in messages %}}[{{{{ m.role }}}}] {{{{ m.content }}}}{{% endfor %}}"
''')
    proc = ServerProcess("--config", str(config), log_path=str(tmp_path / "server.log"))
    try:
        from openai import OpenAI

        client = OpenAI(base_url=proc.url + "/v1", api_key="none")
        assert sorted(m.id for m in client.models.list().data) == ["hf", "small"]
        answer = client.chat.completions.create(model="gpt-4o-mini", messages=HI, max_tokens=2)
        assert answer.model == "small"
        cards = {m["id"]: m for m in httpx.get(proc.url + "/v1/models", timeout=30).json()["data"]}
        assert cards["small"]["loaded"] and cards["small"]["max_model_len"] == 1024
        assert cards["small"]["dtype"] == "bfloat16"  # the server's default
        client.chat.completions.create(model="hf", messages=HI, max_tokens=2)
        cards = {m["id"]: m for m in httpx.get(proc.url + "/v1/models", timeout=30).json()["data"]}
        assert cards["hf"]["dtype"] == "float32"  # its own option
        rendered = httpx.post(proc.url + "/apply-template", timeout=60,
                              json={"model": "hf", "messages": HI}).json()
        assert rendered["prompt"] == "[user] Say hello."  # its own chat template
        rendered = httpx.post(proc.url + "/apply-template", timeout=60,
                              json={"model": "small", "messages": HI}).json()
        assert rendered["prompt"].startswith("<|im_start|>")  # the file's own
    finally:
        proc.stop()
