"""LoRA adapters through the real server and the official clients: picked by `model` (OpenAI,
Ollama, Anthropic) or llama.cpp's `lora` field, listed with their base, loaded and unloaded
at run time by an admin while streams run, bad inputs refused with clear errors; and the
same through the engine process with API keys."""
import json
import threading

import httpx
import pytest

from lora_adapters import QUESTION
from server_process import ServerProcess

pytestmark = pytest.mark.slow
ASK = {"prompt": QUESTION, "max_tokens": 10, "temperature": 0}


@pytest.fixture(scope="module")
def lora_server(trained_loras, tmp_path_factory):
    _, paths, _ = trained_loras
    proc = ServerProcess("--dtype", "float32", "--kv-cache-memory", str(128 << 20),
                         "--max-model-len", "1024", "--served-model-name", "smollm2",
                         "--lora", f"zorblax={paths['zorblax']}", "--max-loras", "2",
                         log_path=str(tmp_path_factory.mktemp("lora") / "server.log"))
    yield proc
    proc.stop()


def complete(url, model, headers=None, **extra):
    answer = httpx.post(url + "/v1/completions", json={**ASK, "model": model, **extra},
                        headers=headers, timeout=300)
    return answer


def test_a_request_picks_its_adapter_by_model(lora_server):
    from openai import OpenAI

    client = OpenAI(base_url=lora_server.url + "/v1", api_key="unused", max_retries=0,
                    timeout=300)
    tuned = client.completions.create(model="zorblax", **ASK)
    base = client.completions.create(model="smollm2", **ASK)
    assert "Zorblax" in tuned.choices[0].text and tuned.model == "zorblax"
    assert "Zorblax" not in base.choices[0].text
    chat = client.chat.completions.create(model="zorblax", max_tokens=5, messages=[
        {"role": "user", "content": "hi"}])
    assert chat.model == "zorblax"


def test_adapters_are_listed_with_their_base(lora_server):
    models = httpx.get(lora_server.url + "/v1/models").json()["data"]
    card = next(m for m in models if m["id"] == "zorblax")
    assert card["parent"] == "smollm2" and card["kind"] == "lora" and card["lora_rank"] == 8
    tags = httpx.get(lora_server.url + "/api/tags").json()["models"]
    tag = next(t for t in tags if t["name"] == "zorblax:latest")
    assert tag["details"]["parent_model"] == "smollm2"
    listed = httpx.get(lora_server.url + "/lora-adapters").json()
    assert [(a["id"], a["name"]) for a in listed] == [(0, "zorblax")]
    complete(lora_server.url, "zorblax")
    page = httpx.get(lora_server.url + "/v1/server/state").json()["adapters"]
    assert [(a["name"], a["format"], a["rank"]) for a in page] == [("zorblax", "peft", 8)]
    assert page[0]["requests"] >= 1 and page[0]["running"] == 0


def test_ollama_and_anthropic_clients_reach_the_adapter(lora_server):
    import anthropic
    import ollama

    answer = ollama.Client(host=lora_server.url).generate(
        model="zorblax", prompt=QUESTION, raw=True, options={"temperature": 0, "num_predict": 10})
    assert "Zorblax" in answer.response
    shown = httpx.post(lora_server.url + "/api/show", json={"model": "zorblax"}).json()
    assert "ADAPTER" in shown["modelfile"] and shown["details"]["parent_model"] == "smollm2"
    message = anthropic.Anthropic(base_url=lora_server.url, api_key="unused").messages.create(
        model="zorblax", max_tokens=5, messages=[{"role": "user", "content": "hi"}])
    assert message.model == "zorblax"


def test_llama_cpps_lora_field_picks_and_weighs_an_adapter(lora_server):
    url = lora_server.url
    picked = complete(url, "smollm2", lora=[{"id": 0, "scale": 1.0}]).json()
    assert "Zorblax" in picked["choices"][0]["text"]
    off = complete(url, "smollm2", lora=[{"id": 0, "scale": 0.0}]).json()
    assert "Zorblax" not in off["choices"][0]["text"]
    for lora, status, words in (([{"id": 7}], 400, "no adapter has id 7"),
                                ([{"id": 0, "scale": 99}], 400, "scale"),
                                ([{"id": 0}, {"id": 0}], 400, "one adapter a request")):
        refused = complete(url, "smollm2", lora=lora)
        assert refused.status_code == status and words in refused.text, refused.text
        assert refused.json()["error"]["param"].startswith("lora")
    # NaN is what Python's json writes for float("nan"); it is no scale (nor "above 10").
    nan = httpx.post(url + "/v1/completions", headers={"Content-Type": "application/json"},
                     content='{"model": "smollm2", "prompt": "Hi", "max_tokens": 2, '
                             '"lora": [{"id": 0, "scale": NaN}]}')
    assert nan.status_code == 400 and "finite number" in nan.text, nan.text


def test_an_unknown_model_names_the_adapters_too(lora_server):
    refused = complete(lora_server.url, "nope")
    assert refused.status_code == 404
    assert "`smollm2`, `zorblax`" in refused.json()["error"]["message"]


def test_loading_and_unloading_at_run_time_loses_no_stream(lora_server, trained_loras):
    _, paths, gguf = trained_loras
    url = lora_server.url
    texts, errors = [], []

    def stream(model):
        try:
            with httpx.stream("POST", url + "/v1/completions", timeout=300, json={
                    **ASK, "model": model, "stream": True, "max_tokens": 24}) as answer:
                chunks = [json.loads(line[6:]) for line in answer.iter_lines()
                          if line.startswith("data: {")]
            texts.append((model, "".join(c["choices"][0]["text"] for c in chunks),
                          chunks[-1]["choices"][0]["finish_reason"]))
        except Exception as exc:  # noqa: BLE001 - the assertion below reports it
            errors.append(exc)

    threads = [threading.Thread(target=stream, args=(m,)) for m in ("zorblax", "smollm2") * 3]
    for t in threads:
        t.start()
    for round_ in range(3):  # while they stream: load, use and unload another adapter
        loaded = httpx.post(url + "/v1/load_lora_adapter", timeout=60, json={
            "lora_name": "quibbit", "lora_path": paths["quibbit"]})
        assert loaded.status_code == 200 and "quibbit" in loaded.text
        assert "Quibbit" in complete(url, "quibbit").json()["choices"][0]["text"]
        unloaded = httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "quibbit"})
        assert unloaded.status_code == 200
    for t in threads:
        t.join()
    assert not errors and len(texts) == 6
    assert all(reason == "length" for _, _, reason in texts)
    assert all(("Zorblax" in text) == (model == "zorblax") for model, text, _ in texts)
    assert complete(url, "quibbit").status_code == 404
    # a GGUF LoRA file loads the same way
    assert httpx.post(url + "/v1/load_lora_adapter", json={
        "lora_name": "zorblax-gguf", "lora_path": gguf}).status_code == 200
    assert "Zorblax" in complete(url, "zorblax-gguf").json()["choices"][0]["text"]
    metrics = httpx.get(url + "/metrics").text
    assert 'pagedllm:lora_requests_total{adapter="zorblax-gguf",model_name="smollm2"} 1.0' in metrics


def test_bad_loads_are_refused_and_nothing_is_half_loaded(lora_server, trained_loras,
                                                          tmp_path):
    _, paths, _ = trained_loras
    url = lora_server.url
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text('{"r": 8, "lora_alpha": 16}')
    (broken / "adapter_model.safetensors").write_bytes(b"\x00" * 64)
    cases = [({"lora_name": "zorblax", "lora_path": paths["zorblax"]}, 400, "already loaded"),
             ({"lora_name": "smollm2", "lora_path": paths["zorblax"]}, 400, "served model"),
             ({"lora_name": "SmolLM2", "lora_path": paths["zorblax"]}, 400, "served model"),
             ({"lora_name": "sm\u043ellm2", "lora_path": paths["zorblax"]}, 400, "served model"),
             ({"lora_name": "ZORBLAX", "lora_path": paths["quibbit"]}, 400, "reads as the loaded"),
             ({"lora_name": "x", "lora_path": str(tmp_path / "none")}, 400, "does not exist"),
             ({"lora_name": "x", "lora_path": str(broken)}, 400, "not a readable safetensors"),
             ({"lora_name": "x"}, 400, "lora_path"),
             ({"lora_name": "has space", "lora_path": paths["quibbit"]}, 400, "spaces")]
    for body, status, words in cases:
        refused = httpx.post(url + "/v1/load_lora_adapter", json=body)
        assert refused.status_code == status and words in refused.text, (body, refused.text)
        about_the_name = words in ("already loaded", "served model", "reads as the loaded",
                                   "spaces")
        assert refused.json()["error"]["param"] == ("lora_name" if about_the_name
                                                    else "lora_path"), refused.text
    gone = httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "nope"})
    assert gone.status_code == 404 and "zorblax" in gone.text
    names = [m["id"] for m in httpx.get(url + "/v1/models").json()["data"]]
    assert "x" not in names and "has space" not in names
    assert "Zorblax" in complete(url, "zorblax").json()["choices"][0]["text"]


def test_the_engine_process_serves_adapters_and_only_admins_change_them(trained_loras,
                                                                        tmp_path):
    _, paths, _ = trained_loras
    keys = tmp_path / "keys.txt"
    keys.write_text("alice sk-alice-0123456789\nroot sk-root-0123456789 admin=yes\n")
    keys.chmod(0o600)
    proc = ServerProcess("--dtype", "float32", "--kv-cache-memory", str(128 << 20),
                         "--max-model-len", "1024", "--engine-process", "--api-key-file",
                         str(keys), "--lora", f"zorblax={paths['zorblax']}",
                         log_path=str(tmp_path / "server.log"))
    alice = {"Authorization": "Bearer sk-alice-0123456789"}
    root = {"Authorization": "Bearer sk-root-0123456789"}
    try:
        assert "Zorblax" in complete(proc.url, "zorblax", alice).json()["choices"][0]["text"]
        load = {"lora_name": "quibbit", "lora_path": paths["quibbit"]}
        refused = httpx.post(proc.url + "/v1/load_lora_adapter", json=load, headers=alice)
        assert refused.status_code == 403 and "admin" in refused.text
        assert httpx.post(proc.url + "/v1/load_lora_adapter", json=load).status_code == 401
        assert httpx.post(proc.url + "/v1/load_lora_adapter", json=load,
                          headers=root).status_code == 200
        assert "Quibbit" in complete(proc.url, "quibbit", alice).json()["choices"][0]["text"]
        # Files on the server are the admins' to see: no paths for alice.
        for who, sees in ((alice, False), (root, True)):
            listed = httpx.get(proc.url + "/lora-adapters", headers=who).json()
            assert [a["path"] is not None for a in listed] == [sees, sees]
            models = httpx.get(proc.url + "/v1/models", headers=who).json()["data"]
            roots = [m["root"] for m in models if m.get("kind") == "lora"]
            assert roots == ([paths["zorblax"], paths["quibbit"]] if sees else [None, None])
    finally:
        proc.stop()


def test_an_adapter_named_like_the_model_at_start_is_one_line_and_no_server(trained_loras,
                                                                            tmp_path):
    """A Cyrillic "о" in the base's name: requests for the base would reach the adapter."""
    _, paths, _ = trained_loras
    proc = ServerProcess("--served-model-name", "smollm2", "--lora",
                         f"sm\u043ellm2={paths['zorblax']}", log_path=str(tmp_path / "server.log"),
                         wait_ready=False)
    assert proc.proc.wait(600) == 2
    assert "reads as the served model's name `smollm2`" in proc.output()
    proc.stop()


def test_a_bad_adapter_at_start_is_one_line_and_no_server(trained_loras, tmp_path):
    _, paths, _ = trained_loras
    proc = ServerProcess("--lora", f"zorblax={paths['zorblax']}", "--max-lora-rank", "4",
                         log_path=str(tmp_path / "server.log"), wait_ready=False)
    assert proc.proc.wait(600) == 2  # a bound, not a speed: a busy CI host loads slowly
    assert "error: adapter zorblax has rank 8, above this server's --max-lora-rank 4" in \
        proc.output()
    proc.stop()


def test_a_model_stores_adapters_sit_beside_their_base(trained_loras, tmp_path):
    import os

    from pagedllm.weights import default_model_path

    _, paths, gguf = trained_loras
    store = tmp_path / "models"
    (store / "smol.loras").mkdir(parents=True)
    os.symlink(default_model_path(), store / "smol.gguf")
    os.symlink(paths["zorblax"], store / "smol.loras" / "zorblax")
    os.symlink(gguf, store / "smol.loras" / "zorblax-gguf.gguf")
    os.symlink(gguf, store / "stray.gguf")  # an adapter without its base's folder: not a model
    proc = ServerProcess("--models-dir", str(store), "--dtype", "float32", "--kv-cache-memory",
                         str(128 << 20), log_path=str(tmp_path / "server.log"))
    try:
        models = {m["id"]: m for m in httpx.get(proc.url + "/v1/models").json()["data"]}
        assert set(models) == {"smol", "zorblax", "zorblax-gguf"}
        assert models["zorblax"]["parent"] == "smol" and models["zorblax"]["kind"] == "lora"
        for model in ("zorblax", "zorblax-gguf"):
            answer = complete(proc.url, model).json()
            assert "Zorblax" in answer["choices"][0]["text"] and answer["model"] == model
        assert "Zorblax" not in complete(proc.url, "smol").json()["choices"][0]["text"]
        missing = complete(proc.url, "stray")
        assert missing.status_code == 404 and "`zorblax`" in missing.text
    finally:
        proc.stop()


def test_a_store_refuses_an_adapter_named_like_a_model(tmp_path):
    import os

    from pagedllm.serving.model_store import ModelCatalog, StoreError, scan_models_dir
    from pagedllm.weights import default_model_path

    (tmp_path / "a.loras" / "b").mkdir(parents=True)
    (tmp_path / "a.loras" / "b" / "adapter_config.json").write_text("{}")
    os.symlink(default_model_path(), tmp_path / "a.gguf")
    os.symlink(default_model_path(), tmp_path / "b.gguf")
    with pytest.raises(StoreError, match="the adapter 'b' of a has the name of another model"):
        ModelCatalog(scan_models_dir(str(tmp_path)))
