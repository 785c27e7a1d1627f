"""What is known of a model without loading it (architecture, parameters, quantization,
size, context), read from a GGUF's header or a folder's config and safetensors headers:
the store's `describe` and Ollama's /api/tags and /api/show."""
from __future__ import annotations

import datetime
import hashlib
import math
import os
from dataclasses import dataclass


def is_sentence_folder(path: str) -> bool:
    """A sentence-transformers folder: its modules.json lists the pooling after the encoder."""
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, "modules.json"))


@dataclass(frozen=True)
class ModelCard:
    """What is known of a model without loading it."""

    architecture: str
    parameters: int
    quantization: str  # a GGUF's file type ("Q4_K_M"), "none" for a folder
    file_bytes: int
    context_length: int
    modified: float  # the file's mtime
    format: str  # "gguf" or "safetensors"

    @property
    def parameter_size(self) -> str:  # as Ollama writes it
        p = self.parameters
        return f"{p / 1e6:.0f}M" if p < 1e9 else f"{p / 1e9:.1f}B"

    def digest(self, path: str) -> str:
        # Identifies the file (path, size, time), not its bytes: hashing GBs costs seconds.
        return hashlib.sha256(f"{path}:{self.file_bytes}:{self.modified}".encode()).hexdigest()

    @property
    def modified_at(self) -> str:
        return datetime.datetime.fromtimestamp(self.modified, datetime.timezone.utc).isoformat()


def describe(path: str) -> ModelCard:
    """The card of a model file or folder, from its header (a GGUF: ~1 s; call off the event
    loop)."""
    is_file = os.path.isfile(path)
    if is_sentence_folder(path):
        return _describe_sentence_folder(path)
    from pagedllm.weights.inspect import summarize_checkpoint

    summary = summarize_checkpoint(path)
    size = os.path.getsize(path) if is_file else _folder_bytes(path)
    return ModelCard(summary.config.architecture,
                     summary.num_embedding_params + summary.num_body_params,
                     summary.file_type or "none", size, summary.config.max_position_embeddings,
                     os.stat(path).st_mtime, "gguf" if is_file else "safetensors")


def _folder_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path)
               if os.path.isfile(os.path.join(path, f)))


def _describe_sentence_folder(path: str) -> ModelCard:
    """A sentence-transformers folder's card, from config.json and the safetensors header."""
    import json

    from safetensors import safe_open

    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    parameters = 0
    for name in os.listdir(path):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(path, name), "pt") as tensors:
                for key in tensors.keys():
                    parameters += math.prod(tensors.get_slice(key).get_shape())
    return ModelCard(str(config.get("model_type", "bert")), parameters, "none",
                     _folder_bytes(path), int(config.get("max_position_embeddings", 512)),
                     os.stat(path).st_mtime, "safetensors")
