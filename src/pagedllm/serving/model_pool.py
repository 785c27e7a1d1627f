"""A model store's loaded models: each its own engine (KV pool, scheduler, loop thread) in
this process, loaded on its first request, unloaded when its keep-alive runs out or when a
newly asked model needs the room (core/residency.py decides which), never while busy. What
a model costs and how its engine is loaded and run on its own thread: model_loading.py.

The pool is also the server's EngineClient for what concerns every model at once (requests
in flight, aborts, published figures, key policies, run/shutdown), so draining, key
revocation and /metrics work unchanged; a request's own work (make_request, submit, the
tokenizer) goes to the engine of the model it names, which it holds (a lease) from the
moment it is routed until its requests are submitted, so nothing unloads under it.
"""
from __future__ import annotations

import asyncio
import dataclasses
import gc
import logging
import threading
import time

from pagedllm.config import EngineConfig
from pagedllm.core.residency import (DEFAULT_KEEP_ALIVE, NeverFits, Resident, expired,
                                     make_room)
from pagedllm.core.snapshot import EngineSnapshot
from pagedllm.serving.client import EngineFigures
from pagedllm.serving.loaded_model import (LoadedModel, ModelLoadFailed, ModelsBusy,
                                           ModelTooLarge, PoolEvents)
from pagedllm.serving.model_loading import (embedding_bytes, estimate_resident_bytes,
                                            load_embedding, load_engine, start_on_own_thread,
                                            thread_governor, UnloadedClient)
from pagedllm.serving.model_store import ModelCatalog, StoreEntry

__all__ = ["ModelPool", "ModelsBusy", "ModelTooLarge", "ModelLoadFailed",
           "estimate_resident_bytes"]

logger = logging.getLogger("pagedllm.models")
REAP_INTERVAL = 0.25  # seconds between keep-alive checks


class ModelPool:
    def __init__(self, catalog: ModelCatalog, base_config: EngineConfig, *,
                 max_loaded_models: int | None = 3, max_memory: int | None = None,
                 keep_alive: float = DEFAULT_KEEP_ALIVE, num_threads: int | None = None,
                 load=load_engine, estimate=estimate_resident_bytes,
                 load_embedding=load_embedding, estimate_embedding=embedding_bytes):
        """max_memory bounds the loaded models' weights + KV together (None: no bound);
        num_threads: each engine's compute threads (default: torch's now)."""
        import torch

        self.catalog = catalog
        self.base_config = base_config
        self.max_loaded_models = max_loaded_models
        self.max_memory = max_memory
        self.keep_alive = keep_alive
        self.num_threads = num_threads or torch.get_num_threads()
        self.events = PoolEvents()
        self.dead: str | None = None  # a store keeps serving when one model fails
        self.restarting: str | None = None
        self.stalled: str | None = None  # each model's client says its own
        self.loras = None  # adapters are served over one model (serve --lora), not a store
        self._load, self._estimate = load, estimate
        self._load_embedding, self._estimate_embedding = load_embedding, estimate_embedding
        self._loaded: dict[str, LoadedModel] = {}
        self._mutex = threading.Lock()  # the loaded dict and leases (event loop + reaper)
        self._loading: asyncio.Lock | None = None  # one load at a time (the budget's view)
        self._stopped = threading.Event()
        self._policies: tuple[dict, dict] = ({}, {})

    # -- what a request asks of the pool (event loop) -----------------------------------------
    async def acquire(self, entry: StoreEntry, keep_alive: float | None = None) -> LoadedModel:
        """The entry's engine, loaded first if it is not (the caller waits; other models keep
        serving), leased to the caller until release(). Raises ModelsBusy, ModelTooLarge or
        ModelLoadFailed."""
        loaded = self._lease(entry.name, keep_alive)
        if loaded is not None:
            return loaded
        if self._loading is None:
            self._loading = asyncio.Lock()
        async with self._loading:
            loaded = self._lease(entry.name, keep_alive)
            if loaded is None:
                loaded = await asyncio.to_thread(self._load_leased, entry, keep_alive)
        return loaded

    def preload(self, name: str) -> None:
        """Load a model now (serve --model with a store), idle afterwards."""
        self.release(self._load_leased(self.catalog.entries[name], None))

    def release(self, loaded: LoadedModel) -> None:
        with self._mutex:
            loaded.leases -= 1
            loaded.last_used = time.monotonic()

    def _lease(self, name: str, keep_alive: float | None) -> LoadedModel | None:
        with self._mutex:
            loaded = self._loaded.get(name)
            if loaded is not None:
                loaded.leases += 1
                loaded.last_used = time.monotonic()
                loaded.keep_alive = self.keep_alive if keep_alive is None else keep_alive
            return loaded

    def loaded(self) -> list[LoadedModel]:
        with self._mutex:
            return list(self._loaded.values())

    def get(self, name: str) -> LoadedModel | None:
        return self._loaded.get(name)

    # -- loading and unloading (a worker thread; the reaper) ---------------------------------
    def _load_leased(self, entry: StoreEntry, keep_alive: float | None) -> LoadedModel:
        # Other models may load beside it: on a GPU its KV pool leaves them room.
        config = dataclasses.replace(entry.engine_config(self.base_config), shares_device=True)
        embedding = entry.kind == "embedding"
        try:
            weights, kv = (self._estimate_embedding(entry) if embedding
                           else self._estimate(config))
        except Exception as exc:  # noqa: BLE001 - an unreadable file is the client's answer
            raise ModelLoadFailed(f"cannot read model {entry.name}: {exc}") from exc
        with self._mutex:
            resident = [Resident(m.name, m.size_bytes, m.busy, m.last_used)
                        for m in self._loaded.values()]
            try:
                names = make_room(resident, weights + kv, self.max_loaded_models, self.max_memory)
            except NeverFits as exc:
                raise ModelTooLarge(
                    f"model {entry.name} needs about {(weights + kv) / 2**20:,.0f} MiB (weights "
                    f"{weights / 2**20:,.0f} MiB + KV cache {kv / 2**20:,.0f} MiB), more than "
                    f"--max-memory ({self.max_memory / 2**20:,.0f} MiB); give it a smaller "
                    f"kv-cache-memory or raise --max-memory") from exc
            if names is None:
                self.events.refusals += 1
                busy = ", ".join(m.name for m in self._loaded.values() if m.busy)
                raise ModelsBusy(f"model {entry.name} does not fit while {busy} "
                                 f"{'is' if ',' not in busy else 'are'} busy "
                                 f"(--max-loaded-models {self.max_loaded_models}, --max-memory "
                                 f"{self.max_memory}); retry when they finish")
            victims = [self._loaded.pop(name) for name in names]
        for victim in victims:
            self._stop(victim, "room")
        started = time.monotonic()
        try:
            client, thread = self._start(
                entry.name, (lambda: self._load_embedding(entry)) if embedding
                else (lambda: self._load(config)),
                threads=1 if embedding else None)  # its service computes with one
        except Exception as exc:  # noqa: BLE001 - said to the client, logged here
            logger.exception("loading model %s failed", entry.name)
            raise ModelLoadFailed(f"loading model {entry.name} failed: {exc}") from exc
        seconds = time.monotonic() - started
        client.set_user_policies(*self._policies)
        template = dict(entry.chat_settings).get("chat_template")
        if template is not None:  # its [models] entry's, in its own template's place
            client.tokenizer.set_chat_template(template)
        loaded = LoadedModel(entry, client, thread, weights + int(client.info.kv_memory_bytes),
                             time.time(), time.monotonic(),
                             self.keep_alive if keep_alive is None else keep_alive, leases=1)
        with self._mutex:
            self._loaded[entry.name] = loaded
            self.events.loads[entry.name] += 1
            self.events.load_seconds[entry.name] = seconds
        logger.info("model %s loaded on first request in %.1fs (about %.0f MiB with its KV "
                    "cache); %d model(s) loaded", entry.name, seconds, loaded.size_bytes / 2**20,
                    len(self._loaded))
        return loaded

    def _threads_for_next(self) -> int:
        """Compute threads for a model about to load: what the loaded ones leave of
        --threads, at least 1. Each engine thread that runs parallel torch work gets an
        OpenMP team of its own; once the teams together hold more threads than there are
        cores, libgomp stops spinning between parallel regions and every region pays a
        futex wake-up: a busy model ran ~28 % slower beside an idle one (BENCHMARKS.md,
        "Model store"). With this, the teams never hold more than --threads."""
        with self._mutex:
            taken = sum(m.threads for m in self._loaded.values())
        return max(1, self.num_threads - taken)

    def _start(self, name: str, load, threads: int | None = None
               ) -> tuple[object, threading.Thread]:
        threads = threads or self._threads_for_next()
        client, thread = start_on_own_thread(name, load, threads)
        loop = getattr(client, "loop", None)
        if loop is not None and threads > 1:
            loop.before_step = thread_governor(
                threads, lambda: any(m.client is not client and m.client.num_in_flight
                                     for m in list(self._loaded.values())))
        return client, thread

    def _stop(self, loaded: LoadedModel, reason: str) -> None:
        loaded.client.shutdown()
        loaded.thread.join(timeout=30)
        self.events.unloads[(loaded.name, reason)] += 1
        logger.info("model %s unloaded (%s)", loaded.name, {
            "room": "to make room for another model", "expired": "its keep_alive ran out",
            "failed": "its engine failed", "shutdown": "server shutting down"}.get(reason, reason))
        # The engine's tensors go with the last reference; a reader that took this model from
        # the table just before it left (a listing, the page, a scrape) finds an idle,
        # empty client in its place, never a missing one.
        loaded.client = UnloadedClient(loaded.client.info)
        gc.collect()
        from pagedllm.engine.factory import _return_freed_memory
        _return_freed_memory()

    def reap(self, now: float | None = None) -> list[str]:
        """Unload the idle models whose keep-alive ran out and the failed ones; a busy
        model's keep-alive restarts (it counts from the end of the last request)."""
        now = time.monotonic() if now is None else now
        with self._mutex:
            gone = []
            for name, loaded in list(self._loaded.items()):
                if loaded.client.dead:
                    gone.append((self._loaded.pop(name), "failed"))
                elif loaded.busy:
                    loaded.last_used = now
                elif expired(loaded.last_used, loaded.keep_alive, now):
                    gone.append((self._loaded.pop(name), "expired"))
        for loaded, reason in gone:
            self._stop(loaded, reason)
        return [loaded.name for loaded, _ in gone]

    # -- EngineClient, for every model at once -----------------------------------------------
    info = None  # no one model's: the server asks each loaded model's client

    @property
    def num_in_flight(self) -> int:
        return sum(m.client.num_in_flight for m in self.loaded())

    def abort(self, request_id: str) -> None:
        for loaded in self.loaded():  # ids are unique: only the engine holding it acts
            loaded.client.abort(request_id)

    def abort_all(self) -> None:
        for loaded in self.loaded():
            loaded.client.abort_all()

    def figures(self) -> list[EngineFigures]:
        rows = []
        for loaded in self.loaded():
            rows += [dataclasses.replace(row, model=loaded.name)
                     for row in loaded.client.figures()]
        return rows

    async def snapshot(self, replica: str | None = None) -> EngineSnapshot:
        """The named model's engine picture (default: the most recently used loaded one)."""
        models = sorted((m for m in self.loaded() if m.kind == "chat"),
                        key=lambda m: -m.last_used)
        chosen = next((m for m in models if m.name == replica), None) if replica else (
            models[0] if models else None)
        if chosen is None:
            raise LookupError(f"model {replica} is not loaded" if replica else "no model is loaded")
        return await chosen.client.snapshot()

    def set_user_policies(self, weights: dict[str, float], max_running: dict[str, int]) -> None:
        self._policies = (dict(weights), dict(max_running))
        for loaded in self.loaded():
            loaded.client.set_user_policies(weights, max_running)

    def run(self) -> None:
        """The main thread: check keep-alives until shutdown()."""
        while not self._stopped.wait(REAP_INTERVAL):
            try:
                self.reap()
            except Exception:  # noqa: BLE001 - the reaper must outlive one bad unload
                logger.exception("unloading an idle model failed")

    def shutdown(self) -> None:
        self._stopped.set()
        with self._mutex:
            every = list(self._loaded.values())
            self._loaded.clear()
        for loaded in every:
            self._stop(loaded, "shutdown")
