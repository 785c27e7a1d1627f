"""The one served model as Ollama's /api/tags, /api/show and /api/ps describe a model."""
from __future__ import annotations

import datetime
import functools
import hashlib
import os

from pagedllm.server.errors import APIError
from pagedllm.server.ollama_protocol import DEFAULT_TEMPERATURE, DEFAULT_TOP_K, DEFAULT_TOP_P
from pagedllm.server.state import ServerState


class ModelInfo:
    """The one served model as Ollama's listing, show and ps describe a model."""

    def __init__(self, state: ServerState):
        self.state = state
        name = state.served_model_name
        self.name = name if ":" in name else f"{name}:latest"
        self._accepted = {name, self.name}
        path = state.client.info.model_path
        self.path = path
        stat = os.stat(path)
        self.size = stat.st_size if os.path.isfile(path) else sum(
            os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
        self.modified_at = datetime.datetime.fromtimestamp(
            stat.st_mtime, datetime.timezone.utc).isoformat()
        # Identifies the file (path, size, time), not its bytes: hashing a multi-GB model
        # at start would cost seconds for a field no client checks.
        self.digest = hashlib.sha256(f"{path}:{self.size}:{stat.st_mtime_ns}".encode()).hexdigest()

    def check(self, model: str) -> None:
        self.state.check_model(None)  # draining
        if not model:
            raise APIError(400, "model is required", "model")
        if model not in self._accepted and not self.state.answers_to(model):
            raise APIError(404, f"model '{model}' not found; this server serves "
                                f"'{self.name}'", "model")

    def details(self) -> dict:
        return dict(self._details)

    @functools.cached_property
    def _details(self) -> dict:
        # Read from the file once (its header and every tensor's shape: ~1 s for a GGUF).
        from pagedllm.weights.inspect import summarize_checkpoint

        config = self.state.client.info.model_config
        summary = summarize_checkpoint(self.path)
        params = summary.num_embedding_params + summary.num_body_params
        return {"parent_model": "", "format": "gguf" if os.path.isfile(self.path) else "safetensors",
                "family": config.architecture, "families": [config.architecture],
                "parameter_size": f"{params / 1e6:.0f}M" if params < 1e9 else f"{params / 1e9:.1f}B",
                # a GGUF: the type it was written as; a folder: the dtype served
                "quantization_level": summary.file_type or self.state.client.info.dtype.upper(),
                "parameter_count": params}

    def listing(self) -> dict:
        details = self.details()
        details.pop("parameter_count")
        return {"name": self.name, "model": self.name, "modified_at": self.modified_at,
                "size": self.size, "digest": self.digest, "details": details}

    def memory_bytes(self) -> int:
        return self.size + int(self.state.client.info.kv_memory_bytes or 0)

    def show(self) -> dict:
        client = self.state.client
        config = client.info.model_config
        details = self.details()
        arch = config.architecture
        params = details.pop("parameter_count")
        return {
            "modelfile": f"# served by pagedllm\nFROM {self.path}\n",
            "parameters": (f"temperature {DEFAULT_TEMPERATURE}\ntop_k {DEFAULT_TOP_K}\n"
                           f"top_p {DEFAULT_TOP_P}"),
            "template": client.tokenizer.chat_template or "",
            "details": details,
            "model_info": {
                "general.architecture": arch, "general.parameter_count": params,
                f"{arch}.context_length": client.info.max_model_len,
                f"{arch}.embedding_length": config.hidden_size,
                f"{arch}.block_count": config.num_layers,
                f"{arch}.attention.head_count": config.num_heads,
                f"{arch}.attention.head_count_kv": config.num_kv_heads,
                f"{arch}.vocab_size": config.vocab_size},
            "capabilities": ["completion", "tools"],
            "modified_at": self.modified_at,
        }


def embedding_listing(service) -> dict:
    """/api/tags's entry for the embedding model (serve --embedding-model)."""
    folder = service.model.folder
    size = sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder)
               if os.path.isfile(os.path.join(folder, f)))
    stamp = datetime.datetime.fromtimestamp(os.path.getmtime(folder), datetime.timezone.utc)
    return {"name": f"{service.name}:latest", "model": f"{service.name}:latest",
            "modified_at": stamp.isoformat(), "size": size,
            "digest": hashlib.sha256(f"{folder}:{size}".encode()).hexdigest(),
            "details": {"parent_model": "", "format": "safetensors", "family": "bert",
                        "families": ["bert"], "parameter_size": f"{service.model.parameters / 1e6:.0f}M",
                        "quantization_level": "F32"}}
