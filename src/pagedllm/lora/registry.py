"""The adapters an engine serves, by name: those given at start and those loaded while it
runs; no two names read alike (core/adapter_names.py). Loading reads and checks the whole file
before the name appears (nothing half-loaded); the HTTP thread loads and unloads, the
engine thread reads, under one lock. An unloaded
adapter's requests already running finish with it; its slot is freed after them (the engine
hears of it through take_unloaded)."""
from __future__ import annotations

import threading

from pagedllm.config import LoRAConfig
from pagedllm.model_config import ModelConfig
from pagedllm.lora.adapter import AdapterError, LoRAAdapter
from pagedllm.lora.load import load_adapter
from pagedllm.core.adapter_names import check_name, look_alike


class LoRARegistry:
    def __init__(self, model_config: ModelConfig, config: LoRAConfig, keep_weights: bool = True):
        """keep_weights=False: each adapter is read and checked whole, then only its
        description is kept (a front end whose engine holds the weights)."""
        self.model_config, self.config = model_config, config
        self.keep_weights = keep_weights
        self._adapters: dict[str, LoRAAdapter] = {}
        self._unloaded: list[str] = []
        self._lock = threading.Lock()
        # Requests admitted per adapter name since start (the metrics' counter).
        self.requests_served: dict[str, int] = {}

    def load(self, name: str, path: str) -> LoRAAdapter:
        """Read, check and add an adapter; AdapterError (one line) if it cannot be."""
        check_name(name)
        with self._lock:
            self._check_free(name)
        adapter = load_adapter(name, path, self.model_config, self.config.max_lora_rank)
        if not self.keep_weights:
            adapter = adapter.described()
        with self._lock:
            self._check_free(name)  # a second load of the same name may have won the race
            self._adapters[name] = adapter
        return adapter

    def _check_free(self, name: str) -> None:
        taken = look_alike(name, list(self._adapters))
        if taken == name:
            raise AdapterError(f"an adapter named {name} is already loaded (from "
                               f"{self._adapters[name].path})")
        if taken is not None:
            raise AdapterError(f"the name {name!r} reads as the loaded adapter {taken!r} "
                               f"(case, or look-alike letters): give it another")

    def unload(self, name: str) -> LoRAAdapter:
        with self._lock:
            adapter = self._adapters.pop(name, None)
            if adapter is None:
                raise KeyError(name)
            self._unloaded.append(adapter.key)
        return adapter

    def get(self, name: str) -> LoRAAdapter | None:
        with self._lock:
            return self._adapters.get(name)

    def named(self, model: str | None) -> str | None:
        """The adapter a request's `model` names (Ollama's `NAME:latest` too), or None."""
        if model is None:
            return None
        for name in (model, model.removesuffix(":latest")):
            if self.get(name) is not None:
                return name
        return None

    def adapters(self) -> list[LoRAAdapter]:
        with self._lock:
            return list(self._adapters.values())

    def take_unloaded(self) -> list[str]:
        """Keys of adapters unloaded since the last call (engine thread)."""
        with self._lock:
            keys, self._unloaded = self._unloaded, []
        return keys
