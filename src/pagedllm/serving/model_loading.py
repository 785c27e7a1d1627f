"""A store's model before and while it is loaded (model_pool.py decides when): what it will
hold (estimated from its header, before loading), how its engine is loaded, and the thread it
runs on with its compute threads.
"""
from __future__ import annotations

import concurrent.futures
import os
import threading
import time
from typing import Callable

from pagedllm.config import EngineConfig
from pagedllm.core import sizing
from pagedllm.serving.model_store import StoreEntry


def estimate_resident_bytes(config: EngineConfig, available: int | None = None
                            ) -> tuple[int, int]:
    """(weight bytes, KV bytes) a model will hold once loaded with `config`, from its header:
    a GGUF served in bfloat16 keeps its quantized matrices (about the file's size); otherwise
    every parameter in the dtype, the embeddings in float32. The KV cache as the engine sizes
    it (engine/factory.py), from `available` memory when given (plan), else from what is
    available now."""
    from pagedllm.weights.inspect import summarize_checkpoint

    summary = summarize_checkpoint(config.model)
    element_size = sizing.ELEMENT_SIZES[config.dtype]
    if os.path.isfile(config.model) and config.dtype == "bfloat16":
        weights = os.path.getsize(config.model)
    else:
        weights = summary.weight_bytes(element_size)
    model = summary.config
    full_request = sizing.kv_bytes_per_request(
        model, element_size, config.kv_cache_dtype,
        min(config.max_model_len or model.max_position_embeddings, model.max_position_embeddings),
        config.block_size)
    if available is not None and config.kv_cache_memory is None:
        return weights, sizing.default_kv_memory(available, full_request)
    if available is not None and isinstance(config.kv_cache_memory, float):
        return weights, int(available * config.kv_cache_memory)
    return weights, sizing.resolve_kv_memory(config.kv_cache_memory, full_request)


def embedding_bytes(entry: StoreEntry) -> tuple[int, int]:
    """An embedding model holds its weights (about its files) and no KV cache."""
    path = entry.path
    if os.path.isfile(path):
        return os.path.getsize(path), 0
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path)
               if f.endswith((".safetensors", ".gguf"))), 0


def load_engine(config: EngineConfig):
    from pagedllm.engine.faults import Faults
    from pagedllm.serving.local import LocalEngineClient

    faults = Faults.from_env()
    time.sleep(faults.load_delay)  # a test's slow load (engine/faults.py)
    return LocalEngineClient.load(config, faults=faults)


def load_embedding(entry: StoreEntry):
    from pagedllm.serving.embedding_client import EmbeddingClient

    return EmbeddingClient.load(entry.path, entry.name, entry.pooling)


def start_on_own_thread(name: str, load: Callable[[], object], threads: int
                        ) -> tuple[object, threading.Thread]:
    """The model loaded and run on one thread of its own with `threads` compute threads.
    Built on the thread that steps it: an engine stepped on another thread than the one
    that built it ran a decode step ~2x slower (benchmarks/engine_thread.py: each thread
    that starts OpenMP work gets its own team of workers). Waits for the load; its error is
    raised here."""
    import torch

    loaded: concurrent.futures.Future = concurrent.futures.Future()

    def main() -> None:
        # A new thread starts with the runtime's default thread count, not --threads.
        torch.set_num_threads(threads)
        try:
            client = load()
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting caller
            loaded.set_exception(exc)
            return
        loaded.set_result(client)
        client.run()

    thread = threading.Thread(target=main, daemon=True, name=f"pagedllm-engine-{name}")
    thread.start()
    client = loaded.result()
    client.num_threads = threads
    return client, thread


def thread_governor(threads: int, others_busy: Callable[[], bool]) -> Callable[[], None]:
    """A before-step hook for the model holding the OpenMP team: it steps with one thread
    while another model is busy (their threads then share the cores one each) and with all
    of its own when it is the only one busy; torch.set_num_threads on its loop thread, only
    on a change."""
    import torch

    current = [threads]

    def before_step() -> None:
        wanted = 1 if others_busy() else threads
        if wanted != current[0]:
            torch.set_num_threads(wanted)
            current[0] = wanted
    return before_step


class UnloadedClient:
    """A model's client once its engine is unloaded: idle, publishing nothing."""

    dead = None
    restarting = None
    stalled = None
    loras = None
    num_in_flight = 0

    def __init__(self, info):
        self.info = info

    def figures(self) -> list:
        return []

    def abort(self, request_id: str) -> None:
        pass

    def abort_all(self) -> None:
        pass

    def set_user_policies(self, weights, max_running) -> None:
        pass

    async def snapshot(self, replica: str | None = None):
        raise RuntimeError("the model was unloaded")
