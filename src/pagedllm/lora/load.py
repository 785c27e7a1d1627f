"""An adapter from a path, whatever its format: a PEFT folder or a llama.cpp GGUF file."""
from __future__ import annotations

import os

from pagedllm.model_config import ModelConfig
from pagedllm.lora.adapter import AdapterError, LoRAAdapter
from pagedllm.lora.gguf_adapter import has_gguf_magic, read_gguf_adapter
from pagedllm.lora.peft_folder import is_peft_folder, read_peft_folder


def load_adapter(name: str, path: str, config: ModelConfig,
                 max_rank: int | None = None) -> LoRAAdapter:
    """The adapter at `path` for the base `config`; AdapterError (one line) if it cannot be
    served over it. Nothing is half-loaded: it is all read and checked before it is returned."""
    if not path or not os.path.exists(path):
        raise AdapterError(f"adapter {name}: {path!r} does not exist")
    if is_peft_folder(path):
        return read_peft_folder(name, path, config, max_rank)
    if os.path.isfile(path) and has_gguf_magic(path):
        return read_gguf_adapter(name, path, config, max_rank)
    raise AdapterError(f"adapter {name}: {path} is neither a PEFT folder (adapter_config.json "
                       f"+ adapter_model.safetensors) nor a GGUF LoRA file")
