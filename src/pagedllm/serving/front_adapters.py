"""The LoRA adapters of an engine in another process, as its front end serves them
(serving/process_client.py): each is read and checked here, where requests are checked and
routed and a bad file is refused before the engine hears of it, but only its description
is kept (the engine process holds the weights); a load or unload here is sent on to the
engine (engine/wire.py's LoadAdapter, UnloadAdapter)."""
from __future__ import annotations

from collections.abc import Callable

from pagedllm.config import EngineConfig
from pagedllm.model_config import ModelConfig
from pagedllm.engine import wire
from pagedllm.lora.adapter import LoRAAdapter
from pagedllm.lora.registry import LoRARegistry


class FrontAdapters(LoRARegistry):
    def __init__(self, model_config: ModelConfig, config: EngineConfig,
                 send: Callable[[object], bool]):
        """The start's adapters (config.lora.adapters) are checked here; the engine process
        loads them itself."""
        super().__init__(model_config, config.lora, keep_weights=False)
        for name, path in config.lora.adapters:
            super().load(name, path)
        self._started = dict(config.lora.adapters)
        self._send = send

    def load(self, name: str, path: str) -> LoRAAdapter:
        adapter = super().load(name, path)
        self._send(wire.LoadAdapter(name, path))
        return adapter

    def unload(self, name: str) -> LoRAAdapter:
        adapter = super().unload(name)
        self._send(wire.UnloadAdapter(name))
        return adapter

    def changes_since_start(self) -> list:
        """What brings a fresh engine process (the start's adapters) to these adapters."""
        now = {adapter.name: adapter.path for adapter in self.adapters()}
        started = self._started
        return ([wire.UnloadAdapter(name) for name in started if now.get(name) != started[name]]
                + [wire.LoadAdapter(name, path) for name, path in now.items()
                   if started.get(name) != path])
