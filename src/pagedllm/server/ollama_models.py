"""The served models as Ollama's /api/tags, /api/show and /api/ps describe a model."""
from __future__ import annotations

import datetime
import functools
import hashlib
import os

from pagedllm.server.ollama_protocol import DEFAULT_TEMPERATURE, DEFAULT_TOP_K, DEFAULT_TOP_P
from pagedllm.server.state import ServerState


class ModelInfo:
    """One model (the served one, or a store's) as Ollama's listing, show and ps describe
    it; what is read from its file (serving/model_store.py's card) is read once, on a
    worker thread."""

    def __init__(self, name: str, path: str, dtype: str):
        self.name = name if ":" in name else f"{name}:latest"
        self.path, self.dtype = path, dtype

    @functools.cached_property
    def card(self):
        from pagedllm.serving.model_card import describe

        return describe(self.path)

    def details(self) -> dict:
        card = self.card
        return {"parent_model": "", "format": card.format, "family": card.architecture,
                "families": [card.architecture], "parameter_size": card.parameter_size,
                # a GGUF: the type it was written as; a folder: the dtype served
                "quantization_level": (card.quantization if card.quantization != "none"
                                       else self.dtype.upper())}

    def listing(self) -> dict:
        card = self.card
        return {"name": self.name, "model": self.name, "modified_at": card.modified_at,
                "size": card.file_bytes, "digest": card.digest(self.path),
                "details": self.details()}

    def loaded(self, size: int, expires_at: str, context_length: int) -> dict:
        """/api/ps's entry: the listing with the resident size (weights + KV cache)."""
        return {**self.listing(), "size": size, "size_vram": 0, "expires_at": expires_at,
                "context_length": context_length}

    def show(self, client) -> dict:
        """/api/show's answer, from the loaded model's client."""
        if getattr(client, "kind", "chat") == "embedding":  # a store's embedding model
            model = client.service.model
            return {"modelfile": f"# served by pagedllm\nFROM {self.path}\n", "parameters": "",
                    "template": "", "details": self.details(),
                    "model_info": {"general.architecture": self.card.architecture,
                                   "general.parameter_count": self.card.parameters,
                                   "embedding_length": model.dimensions,
                                   "context_length": model.max_tokens},
                    "capabilities": ["embedding"], "modified_at": self.card.modified_at}
        config = client.info.model_config
        arch = config.architecture
        return {
            "modelfile": f"# served by pagedllm\nFROM {self.path}\n",
            "parameters": (f"temperature {DEFAULT_TEMPERATURE}\ntop_k {DEFAULT_TOP_K}\n"
                           f"top_p {DEFAULT_TOP_P}"),
            "template": client.tokenizer.chat_template or "",
            "details": self.details(),
            "model_info": {
                "general.architecture": arch, "general.parameter_count": self.card.parameters,
                f"{arch}.context_length": client.info.max_model_len,
                f"{arch}.embedding_length": config.hidden_size,
                f"{arch}.block_count": config.num_layers,
                f"{arch}.attention.head_count": config.num_heads,
                f"{arch}.attention.head_count_kv": config.num_kv_heads,
                f"{arch}.vocab_size": config.vocab_size},
            "capabilities": ["completion", "tools"],
            "modified_at": self.card.modified_at,
        }


def model_infos(state: ServerState) -> dict[str, ModelInfo]:
    """Every model the server serves, by its store name (one: the served name)."""
    if state.pool is None:
        info = state.client.info
        return {state.served_model_name: ModelInfo(state.served_model_name, info.model_path,
                                                   info.dtype)}
    catalog, base = state.pool.catalog, state.pool.base_config
    return {name: ModelInfo(name, entry.path, entry.engine_config(base).dtype)
            for name, entry in catalog.entries.items()}


EXPIRES_NEVER = datetime.datetime(2318, 1, 1, tzinfo=datetime.timezone.utc).isoformat()


def expires_at(seconds: float) -> str:
    """/api/ps's expires_at for a model that unloads in `seconds` (inf: never)."""
    if seconds == float("inf"):
        return EXPIRES_NEVER
    return (datetime.datetime.now(datetime.timezone.utc)
            + datetime.timedelta(seconds=seconds)).isoformat()


def embedding_listing(service) -> dict:
    """/api/tags's entry for the embedding model (serve --embedding-model)."""
    path = service.model.folder
    files = [path] if os.path.isfile(path) else [
        os.path.join(path, f) for f in os.listdir(path) if os.path.isfile(os.path.join(path, f))]
    size = sum(os.path.getsize(f) for f in files)
    stamp = datetime.datetime.fromtimestamp(os.path.getmtime(path), datetime.timezone.utc)
    family = getattr(getattr(service.model, "config", None), "architecture", None) or "bert"
    return {"name": f"{service.name}:latest", "model": f"{service.name}:latest",
            "modified_at": stamp.isoformat(), "size": size,
            "digest": hashlib.sha256(f"{path}:{size}".encode()).hexdigest(),
            "details": {"parent_model": "", "format": "gguf" if os.path.isfile(path) else "safetensors",
                        "family": family, "families": [family],
                        "parameter_size": f"{service.model.parameters / 1e6:.0f}M",
                        "quantization_level": {"bfloat16": "BF16"}.get(
                            getattr(service.model, "dtype", ""), "F32")}}
