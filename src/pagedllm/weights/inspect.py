"""A checkpoint's config and parameter counts without loading its weights (for `plan`)."""
from __future__ import annotations

import glob
import math
import os
from dataclasses import dataclass

from pagedllm.config import ModelConfig
from pagedllm.errors import ModelLoadError


@dataclass(frozen=True)
class CheckpointSummary:
    config: ModelConfig
    num_embedding_params: int  # embed_tokens (and lm_head when untied): held in float32
    num_body_params: int  # everything else: held in the model dtype
    file_type: str | None = None  # a GGUF's quantization as written (Q4_1, Q8_0, ...)

    def weight_bytes(self, element_size: int) -> int:
        return self.num_embedding_params * 4 + self.num_body_params * element_size


def summarize_checkpoint(path: str | None) -> CheckpointSummary:
    from pagedllm.weights import default_model_path
    from pagedllm.weights.gguf import canonical_name, read_gguf_header
    from pagedllm.weights.safetensors import _read_json, hf_model_config

    path = default_model_path() if path is None else os.fspath(path)
    counts: dict[str, int] = {}
    file_type = None
    if os.path.isdir(path):
        config_path = os.path.join(path, "config.json")
        if not os.path.isfile(config_path):
            raise ModelLoadError(path, "folder has no config.json (expected a Hugging Face checkpoint)")
        config = hf_model_config(path, _read_json(config_path))
        from safetensors import safe_open
        for file in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
            with safe_open(file, "pt") as f:
                for name in f.keys():
                    counts[name.removeprefix("model.")] = math.prod(f.get_slice(name).get_shape())
    else:
        if not os.path.exists(path):
            raise ModelLoadError(path, "no such file or folder")
        reader, meta, config = read_gguf_header(path)
        file_type = _gguf_file_type(meta.get("general.file_type"))
        for tensor in reader.tensors:
            name = canonical_name(tensor.name)
            if name is not None:
                counts[name] = int(tensor.n_elements)
    embedding = counts.pop("embed_tokens.weight", 0) + counts.pop("lm_head.weight", 0)
    return CheckpointSummary(config, embedding, sum(counts.values()), file_type)


def _gguf_file_type(value) -> str | None:
    from gguf import LlamaFileType

    try:
        return LlamaFileType(int(value)).name.removeprefix("MOSTLY_")
    except (TypeError, ValueError):
        return None
