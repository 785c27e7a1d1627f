"""The model store without a model: the catalog (a models folder, [models] entries, names,
aliases, Ollama's :latest) and the pool's loading, leasing and unloading decisions with
stand-in engines (each load and unload counted), so every rule runs in CI in milliseconds.
The real thing, two real models behind one server, is tests/test_model_store_server.py."""
from __future__ import annotations

import asyncio
import json
import os
import threading
from dataclasses import dataclass
from types import SimpleNamespace

import pytest

from pagedllm.config import EngineConfig
from pagedllm.core.residency import FOREVER
from pagedllm.serving.client import EngineFigures
from pagedllm.serving.model_pool import (ModelLoadFailed, ModelPool, ModelsBusy, ModelTooLarge)
from pagedllm.serving.model_store import (ModelCatalog, StoreEntry, StoreError,
                                          entries_from_table, scan_models_dir)


def make_models_dir(root) -> str:
    (root / "chat.gguf").write_bytes(b"GGUF")
    (root / "coder.GGUF").write_bytes(b"GGUF")
    (root / "notes.txt").write_text("not a model")
    hf = root / "folder-model"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    (hf / "model.safetensors").write_bytes(b"")
    st = root / "minilm"  # a sentence-transformers folder: an embedding model
    st.mkdir()
    for name in ("config.json", "modules.json", "model.safetensors"):
        (st / name).write_text("{}")
    (root / "empty-folder").mkdir()
    return str(root)


def test_a_models_folder_lists_gguf_files_and_hf_folders(tmp_path):
    entries = scan_models_dir(make_models_dir(tmp_path))
    assert [(e.name, e.kind) for e in entries] == [
        ("chat", "chat"), ("coder", "chat"), ("folder-model", "chat"), ("minilm", "embedding")]
    assert all(os.path.isabs(e.path) and os.path.exists(e.path) for e in entries)


def test_a_missing_models_folder_says_so(tmp_path):
    with pytest.raises(StoreError, match="no such folder"):
        scan_models_dir(str(tmp_path / "nope"))


def test_models_table_entries_with_options_and_aliases(tmp_path):
    (tmp_path / "a.gguf").write_bytes(b"GGUF")
    entries = entries_from_table({
        "small": {"path": "a.gguf", "max-model-len": 2048, "dtype": "float32",
                  "kv_cache_memory": "64MiB", "aliases": ["gpt-4o-mini"]},
        "short": "a.gguf"}, "serve.toml", str(tmp_path))
    small, short = entries
    assert small.path == str(tmp_path / "a.gguf") and small.aliases == ("gpt-4o-mini",)
    config = small.engine_config(EngineConfig(dtype="bfloat16", max_num_seqs=4))
    assert (config.model, config.max_model_len, config.dtype, config.kv_cache_memory,
            config.max_num_seqs) == (small.path, 2048, "float32", 64 << 20, 4)
    assert short.engine_config(EngineConfig()).model == short.path


@pytest.mark.parametrize("entry, message", [
    ({"path": "missing.gguf"}, "no model at"),
    ({"max-model-len": 5}, "needs path"),
    ({"path": "a.gguf", "temperature": 1}, "unknown key 'temperature'"),
    ({"path": "a.gguf", "max-model-len": "long"}, "max-model-len"),
    ({"path": "a.gguf", "aliases": "x"}, "aliases is a list"),
    ({"path": "a.gguf", "kind": "vision"}, "kind is one of chat, embedding"),
    ({"path": "a.gguf", "pooling": "mean"}, "pooling goes with kind"),
    ({"path": "a.gguf", "kind": "embedding", "pooling": "max"}, "pooling is last or mean"),
    (7, "needs path"),
])
def test_bad_models_entries_say_what_is_wrong(tmp_path, entry, message):
    (tmp_path / "a.gguf").write_bytes(b"GGUF")
    with pytest.raises(StoreError, match=message):
        entries_from_table({"m": entry}, "serve.toml", str(tmp_path))


def test_catalog_finds_names_tags_and_aliases():
    catalog = ModelCatalog([StoreEntry("chat", "/a"), StoreEntry("coder", "/b", aliases=("gpt-4o",))])
    assert catalog.find("chat").path == "/a" and catalog.find("chat:latest").path == "/a"
    assert catalog.find("gpt-4o").name == "coder" and catalog.find("gpt-4o:latest").name == "coder"
    assert catalog.find("llama3") is None and catalog.find("chat:7b") is None


def test_catalog_refuses_duplicates_and_emptiness():
    with pytest.raises(StoreError, match="two models are named 'x'"):
        ModelCatalog([StoreEntry("x", "/a"), StoreEntry("x", "/b")])
    with pytest.raises(StoreError, match="empty"):
        ModelCatalog([])


# -- the pool, with stand-in engines -----------------------------------------------------------

@dataclass
class FakeInfo:
    kv_memory_bytes: int = 10


class FakeClient:
    """What the pool uses of a LocalEngineClient."""

    def __init__(self, name):
        self.name = name
        self.info = FakeInfo()
        self.num_in_flight = 0
        self.dead = None
        self.policies = None
        self.aborted = []
        self._stop = threading.Event()
        self.loop = SimpleNamespace(before_step=None)  # the AsyncEngine's hook

    def run(self):
        self._stop.wait()

    def shutdown(self):
        self._stop.set()

    def set_user_policies(self, weights, max_running):
        self.policies = (weights, max_running)

    def abort(self, request_id):
        self.aborted.append(request_id)

    def abort_all(self):
        self.aborted.append("*")

    def figures(self):
        return [EngineFigures(None, {}, None, None)]


def make_pool(names=("a", "b", "c"), sizes=None, fail=(), **bounds):
    sizes = sizes or {}
    clients = {}

    def load(config):
        name = os.path.basename(config.model)
        if name in fail:
            raise ValueError("bad file")
        clients[name] = FakeClient(name)
        return clients[name]

    def estimate(config):
        return sizes.get(os.path.basename(config.model), 90), 10

    catalog = ModelCatalog([StoreEntry(n, f"/models/{n}") for n in names])
    pool = ModelPool(catalog, EngineConfig(), load=load, estimate=estimate, num_threads=1,
                     **bounds)
    return pool, catalog, clients


def acquire(pool, catalog, name, keep_alive=None):
    return asyncio.run(pool.acquire(catalog.find(name), keep_alive))


def test_a_store_model_is_loaded_as_sharing_its_device():
    """(On a GPU its KV pool then leaves the next model room: test_generic_backend.py.)"""
    configs = []
    catalog = ModelCatalog([StoreEntry("a", "/models/a")])
    pool = ModelPool(catalog, EngineConfig(), load=lambda c: configs.append(c) or FakeClient("a"),
                     estimate=lambda c: (90, 10), num_threads=1)
    pool.release(acquire(pool, catalog, "a"))
    assert [c.shares_device for c in configs] == [True] and not EngineConfig().shares_device
    pool.shutdown()


def test_a_model_loads_on_first_use_and_is_leased_until_released():
    pool, catalog, clients = make_pool()
    pool.set_user_policies({"alice": 2.0}, {})
    first = acquire(pool, catalog, "a")
    assert first.leases == 1 and first.busy and first.size_bytes == 100
    assert clients["a"].policies == ({"alice": 2.0}, {})  # the keys' policies reach it
    again = acquire(pool, catalog, "a")
    assert again is first and first.leases == 2 and pool.events.loads["a"] == 1
    pool.release(first)
    pool.release(first)
    assert not first.busy
    pool.shutdown()
    assert pool.events.unloads[("a", "shutdown")] == 1 and not first.thread.is_alive()


def test_the_least_recently_used_idle_model_makes_room():
    pool, catalog, clients = make_pool(max_loaded_models=2)
    for name in ("a", "b"):
        pool.release(acquire(pool, catalog, name))
    pool.release(acquire(pool, catalog, "a"))  # a is now the more recent
    pool.release(acquire(pool, catalog, "c"))
    assert sorted(m.name for m in pool.loaded()) == ["a", "c"]
    assert pool.events.unloads == {("b", "room"): 1}
    assert clients["b"]._stop.is_set()
    pool.shutdown()


def test_a_busy_model_is_never_unloaded_for_another():
    pool, catalog, clients = make_pool(max_loaded_models=1)
    held = acquire(pool, catalog, "a")  # a handler holds it
    with pytest.raises(ModelsBusy, match="a is busy"):
        acquire(pool, catalog, "b")
    pool.release(held)
    clients["a"].num_in_flight = 1  # its requests run: still busy
    with pytest.raises(ModelsBusy):
        acquire(pool, catalog, "b")
    assert pool.events.refusals == 2 and [m.name for m in pool.loaded()] == ["a"]
    clients["a"].num_in_flight = 0
    pool.release(acquire(pool, catalog, "b"))
    assert [m.name for m in pool.loaded()] == ["b"]
    pool.shutdown()


def test_memory_budget_counts_weights_and_kv():
    pool, catalog, _ = make_pool(sizes={"a": 290, "b": 190, "c": 990}, max_memory=500,
                                 max_loaded_models=None)
    pool.release(acquire(pool, catalog, "a"))  # 300
    pool.release(acquire(pool, catalog, "b"))  # 200: 500 in all, fits
    assert len(pool.loaded()) == 2
    with pytest.raises(ModelTooLarge, match="more than --max-memory"):
        acquire(pool, catalog, "c")  # 1000 alone
    assert len(pool.loaded()) == 2  # nothing was unloaded for a model that can never fit
    pool.shutdown()


def test_a_failed_load_is_reported_and_leaves_nothing_behind():
    pool, catalog, _ = make_pool(fail=("b",))
    with pytest.raises(ModelLoadFailed, match="loading model b failed: bad file"):
        acquire(pool, catalog, "b")
    assert pool.loaded() == [] and pool.events.loads["b"] == 0
    pool.shutdown()


def test_keep_alive_unloads_an_idle_model_and_restarts_while_busy():
    pool, catalog, clients = make_pool(keep_alive=300.0)
    model = acquire(pool, catalog, "a")
    pool.release(model)
    start = model.last_used
    assert pool.reap(now=start + 299) == []
    clients["a"].num_in_flight = 1  # busy at 299: its keep-alive counts from when it is idle
    assert pool.reap(now=start + 299) == [] and model.last_used == start + 299
    clients["a"].num_in_flight = 0
    assert pool.reap(now=start + 500) == []
    assert pool.reap(now=start + 600) == ["a"]
    assert pool.events.unloads == {("a", "expired"): 1} and pool.loaded() == []
    # A reader that took the model from the table just before (a listing, the page, a
    # scrape) finds an idle client with nothing to publish, not a missing attribute (/api/ps
    # answered 500 AttributeError in that window).
    assert not model.busy and model.expires_in(start + 600) == 0.0
    assert model.client.figures() == [] and model.client.info is clients["a"].info
    model.client.abort("any")
    pool.shutdown()


def test_a_requests_keep_alive_wins_and_zero_unloads_once_idle():
    pool, catalog, _ = make_pool(keep_alive=300.0)
    model = acquire(pool, catalog, "a", keep_alive=0.0)
    assert model.keep_alive == 0.0
    assert pool.reap() == []  # leased: busy
    pool.release(model)
    assert pool.reap() == ["a"]
    forever = acquire(pool, catalog, "b", keep_alive=FOREVER)
    pool.release(forever)
    assert pool.reap(now=forever.last_used + 1e9) == [] and forever.expires_in(0) == FOREVER
    pool.shutdown()


def test_a_failed_engine_is_unloaded_so_the_next_request_reloads_it():
    pool, catalog, clients = make_pool()
    pool.release(acquire(pool, catalog, "a"))
    clients["a"].dead = "3 steps failed"
    assert pool.reap() == ["a"] and pool.events.unloads[("a", "failed")] == 1
    pool.release(acquire(pool, catalog, "a"))
    assert pool.events.loads["a"] == 2
    pool.shutdown()


def test_the_pool_answers_for_every_loaded_model():
    pool, catalog, clients = make_pool()
    for name in ("a", "b"):
        pool.release(acquire(pool, catalog, name))
    clients["a"].num_in_flight, clients["b"].num_in_flight = 2, 3
    assert pool.num_in_flight == 5
    assert sorted(row.model for row in pool.figures()) == ["a", "b"]
    pool.abort("req-1")
    pool.abort_all()
    assert clients["a"].aborted == clients["b"].aborted == ["req-1", "*"]
    clients["a"].num_in_flight = clients["b"].num_in_flight = 0
    pool.shutdown()


def test_plan_says_which_models_fit_at_once():
    from pagedllm.tools.store_plan import plan_store

    entries = [StoreEntry(n, f"/models/{n}") for n in ("big", "small", "mid", "huge")]
    sizes = {"big": 500, "small": 100, "mid": 300, "huge": 2000}

    def estimate(config, available):
        assert available == 1000  # each engine's KV sized against the planned memory
        return sizes[os.path.basename(config.model)] - 50, 50

    plan = plan_store(entries, EngineConfig(), 1000, 3, estimate=estimate)
    assert [(r.model, r.total_bytes) for r in plan.rows] == [
        ("big", 500), ("small", 100), ("mid", 300), ("huge", 2000)]
    assert plan.together == ["small", "mid", "big"] and not plan.all_fit
    assert plan.too_large == ["huge"]
    two = plan_store(entries[:3], EngineConfig(), 1000, 2, estimate=estimate)
    assert two.together == ["small", "mid"] and not two.all_fit
    everything = plan_store(entries[:3], EngineConfig(), 1000, 3, estimate=estimate)
    assert everything.all_fit and everything.too_large == []


def test_plan_command_sizes_a_real_store(tmp_path):
    import subprocess
    import sys

    from pagedllm.weights import default_model_path

    (tmp_path / "smollm2.gguf").symlink_to(default_model_path())
    done = subprocess.run([sys.executable, "-m", "pagedllm.cli", "plan", "--models-dir",
                           str(tmp_path), "--memory", "1GiB", "--json"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    plan = json.loads(done.stdout)
    row = plan["rows"][0]
    assert row["model"] == "smollm2" and row["weight_bytes"] == os.path.getsize(default_model_path())
    assert row["kv_bytes"] == 512 << 20  # the default: half of the memory, as the engine sizes it
    assert plan["together"] == ["smollm2"] and plan["all_fit"]
    missing = subprocess.run([sys.executable, "-m", "pagedllm.cli", "plan", "--models-dir",
                              str(tmp_path / "nope")], capture_output=True, text=True, timeout=120)
    assert missing.returncode == 2 and "no such folder" in missing.stderr


def test_an_embedding_entry_loads_as_an_embedding_model(tmp_path):
    (tmp_path / "e.gguf").write_bytes(b"GGUF" * 10)
    entry, = entries_from_table({"embed": {"path": "e.gguf", "kind": "embedding",
                                           "pooling": "mean"}}, "serve.toml", str(tmp_path))
    assert (entry.kind, entry.pooling) == ("embedding", "mean")
    loaded_as = []

    def load_embedding(e):
        loaded_as.append(e)
        return FakeClient(e.name)

    catalog = ModelCatalog([entry])
    pool = ModelPool(catalog, EngineConfig(), load=None, num_threads=1,
                     load_embedding=load_embedding, estimate_embedding=lambda e: (40, 0))
    model = acquire(pool, catalog, "embed")
    assert loaded_as == [entry] and model.kind == "embedding" and model.size_bytes == 50
    pool.release(model)
    pool.shutdown()


def test_one_model_holds_the_threads_and_yields_them_while_another_is_busy():
    """The first model loaded gets --threads (its OpenMP team), later ones one thread each,
    so the teams never hold more threads than --threads; the first steps with one thread
    while another model is busy, with all of its own when it is the only one."""
    import torch

    before = torch.get_num_threads()
    pool, catalog, clients = make_pool()
    pool.num_threads = 2
    try:
        pool.release(acquire(pool, catalog, "a"))
        pool.release(acquire(pool, catalog, "b"))
        assert (clients["a"].num_threads, clients["b"].num_threads) == (2, 1)
        govern = clients["a"].loop.before_step
        assert govern is not None and clients["b"].loop.before_step is None
        clients["b"].num_in_flight = 1
        govern()
        assert torch.get_num_threads() == 1
        clients["b"].num_in_flight = 0
        govern()
        assert torch.get_num_threads() == 2
        pool.shutdown()
    finally:
        torch.set_num_threads(before)


def test_a_models_entry_brings_its_own_template_and_parsers(tmp_path):
    """chat-template (a file beside the config, or the text), tool-call-parser and
    reasoning-parser per model; bad ones refused naming the entry and the key."""
    from pagedllm.weights import default_model_path

    (tmp_path / "mine.jinja").write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    [entry] = entries_from_table({"chat": {
        "path": default_model_path(), "chat-template": "mine.jinja",
        "tool-call-parser": "mistral", "reasoning-parser": "none"}}, "f.toml", str(tmp_path))
    assert dict(entry.chat_settings) == {
        "chat_template": "{% for m in messages %}{{ m.content }}{% endfor %}",
        "tool_call_parser": "mistral", "reasoning_parser": "none"}
    for key, value, words in [
            ("chat-template", "no-such.jinja", "no such file"),
            ("chat-template", "{% if %}", "does not parse"),
            ("tool-call-parser", "mistal", "choose one of auto, hermes"),
            ("reasoning-parser", "r1", "choose one of auto"),
            ("tool-call-parser", 3, "is text")]:
        with pytest.raises(StoreError, match=rf"\[models.chat\]: {key}.*{words}"):
            entries_from_table({"chat": {"path": default_model_path(), key: value}}, "f.toml",
                               str(tmp_path))
