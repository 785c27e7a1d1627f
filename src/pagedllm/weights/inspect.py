"""A checkpoint's config and parameter counts without loading its weights (for `plan`)."""
from __future__ import annotations

import glob
import math
import os
from dataclasses import dataclass

from pagedllm.model_config import ModelConfig
from pagedllm.errors import ModelLoadError


@dataclass(frozen=True)
class CheckpointSummary:
    config: ModelConfig
    num_embedding_params: int  # embed_tokens (and lm_head when untied): held in float32
    num_body_params: int  # everything else: held in the model dtype
    file_type: str | None = None  # a GGUF's quantization as written (Q4_1, Q8_0, ...)
    # Of the body: the projections --gpu-4bit-weights keeps 4-bit on a GPU (a fused q/k/v or
    # gate/up only where every part is 4-bit, as the loader fuses them).
    num_four_bit_params: int = 0

    def weight_bytes(self, element_size: int, four_bit_on_device: bool = False) -> int:
        """four_bit_on_device: the 4-bit projections as models/int4_triton.py holds them,
        codes (half a byte) and a float32 scale and offset per 32 (a quarter byte)."""
        four_bit = self.num_four_bit_params if four_bit_on_device else 0
        return (self.num_embedding_params * 4 + (self.num_body_params - four_bit) * element_size
                + four_bit * 3 // 4)


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
        types: dict[str, str] = {}
        for tensor in reader.tensors:
            name = canonical_name(tensor.name)
            if name is not None:
                counts[name] = int(tensor.n_elements)
                types[name] = tensor.tensor_type.name
        four_bit = _four_bit_projection_params(counts, types, config)
    embedding = counts.pop("embed_tokens.weight", 0) + counts.pop("lm_head.weight", 0)
    return CheckpointSummary(config, embedding, sum(counts.values()), file_type,
                             four_bit if not os.path.isdir(path) else 0)


# The projections models/build.py replaces with 4-bit ones (its PROJECTIONS), fused as the
# loader fuses them.
_FOUR_BIT_PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def _four_bit_projection_params(counts: dict[str, int], types: dict[str, str],
                                config: ModelConfig) -> int:
    """Parameters of the projections a GPU keeps 4-bit (--gpu-4bit-weights): q/k/v and
    gate/up only where every part is 4-bit (weights/fuse.py's rule), q/k/v never with
    partial rotary (their rows are permuted)."""
    from pagedllm.weights.fuse import fuse_quantized
    from pagedllm.weights.gguf_original import FOUR_BIT_TYPES

    four_bit = {name: n for name, n in counts.items() if types.get(name) in FOUR_BIT_TYPES}
    fused = fuse_quantized(four_bit, config.num_layers, cat=sum)
    return sum(n for name, n in fused.items()
               if name.startswith("layers.") and name.split(".")[-2] in _FOUR_BIT_PROJECTIONS
               and not (config.rotary_dim and name.endswith("qkv_proj.weight")))


def _gguf_file_type(value) -> str | None:
    from gguf import LlamaFileType

    try:
        return LlamaFileType(int(value)).name.removeprefix("MOSTLY_")
    except (TypeError, ValueError):
        return None
