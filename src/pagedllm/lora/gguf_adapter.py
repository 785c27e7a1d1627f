"""llama.cpp's LoRA files: a GGUF with general.type "adapter", adapter.type "lora",
adapter.lora.alpha, and per projection `blk.N.attn_q.weight.lora_a` [r, in] and `.lora_b`
[out, r] (as convert_lora_to_gguf.py writes them). Like the base's q and k rows, llama.cpp
permutes the rows of q and k's lora_b for Llama-family models; they are put back in the
canonical order here, as weights/gguf.py does for the base. The scale is llama.cpp's:
alpha / r, or 1 where alpha is 0."""
from __future__ import annotations

import struct

import numpy as np
import torch

from pagedllm.model_config import ModelConfig
from pagedllm.lora.adapter import (PART_TO_FUSED, AdapterError, LoRAAdapter, PartWeights,
                                   build_adapter, check_pair_shapes, lora_rank)
from pagedllm.weights.gguf import _permuted_heads, canonical_name
from pagedllm.weights.gguf_file import GGUFFile, GGUFFormatError
from pagedllm.weights.permute import unpermute_rows


def has_gguf_magic(path: str) -> bool:
    """The file starts as a GGUF does (whether it is an adapter, reading it says)."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def read_gguf_adapter(name: str, path: str, config: ModelConfig,
                      max_rank: int | None) -> LoRAAdapter:
    from gguf import GGMLQuantizationType, quants

    try:
        reader = GGUFFile(path)
    except (GGUFFormatError, OSError, ValueError, struct.error) as exc:
        raise AdapterError(f"adapter {name}: {path} is not a readable GGUF file: {exc}") from exc
    fields = reader.fields
    kind, adapter_type = fields.get("general.type"), fields.get("adapter.type")
    if kind != "adapter" or adapter_type != "lora":
        raise AdapterError(f"adapter {name}: {path} is a GGUF {kind or 'model'} file, not a LoRA "
                           f"adapter (general.type = adapter, adapter.type = lora)")
    arch = fields.get("general.architecture")
    if not (isinstance(arch, str) and config.architecture.startswith(arch)):
        raise AdapterError(f"adapter {name} was made for a {arch} model; the base model is "
                           f"{config.architecture}")
    alpha = float(fields.get("adapter.lora.alpha", 0.0) or 0.0)
    _check_header(name, path, reader, config, max_rank)  # before any tensor is read
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for tensor in reader.tensors:
        base_name, _, half = tensor.name.rpartition(".")
        part = _part(name, path, tensor.name)
        canonical = canonical_name(base_name)
        try:
            array = np.array(quants.dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        except (NotImplementedError, ValueError) as exc:
            raise AdapterError(f"adapter {name}: tensor {tensor.name} of type "
                               f"{GGMLQuantizationType(tensor.tensor_type).name} cannot be "
                               f"read: {exc}") from exc
        array = array.reshape(tuple(int(n) for n in reversed(tensor.shape)))
        heads = _permuted_heads(config, base_name)
        if half == "lora_b" and heads:
            array = unpermute_rows(array, heads)
        layer = int(canonical.split(".")[1])
        halves.setdefault((layer, part), {})[half] = torch.from_numpy(np.ascontiguousarray(array))
    parts = {}
    for (layer, part), pair in halves.items():
        if set(pair) != {"lora_a", "lora_b"}:
            raise AdapterError(f"adapter {name}: layer {layer} {part} has "
                               f"{' and '.join(pair)} but not its other half")
        rank = lora_rank(name, f"layer {layer} {part}", pair["lora_a"])
        parts[(layer, part)] = PartWeights(pair["lora_a"], pair["lora_b"],
                                           alpha / rank if alpha else 1.0)
    return build_adapter(name, path, "gguf", alpha, parts, config, max_rank)


def _part(name: str, path: str, tensor_name: str) -> str:
    """The checkpoint part a tensor of the file adapts (q_proj, ...), or AdapterError."""
    base_name, _, half = tensor_name.rpartition(".")
    canonical = canonical_name(base_name) if half in ("lora_a", "lora_b") else None
    part = None if canonical is None else canonical.split(".")[-2]
    if part not in PART_TO_FUSED:
        raise AdapterError(f"adapter {name}: {path} holds `{tensor_name}`, a weight pagedllm "
                           f"does not apply (LoRA on q/k/v/o and gate/up/down projections only)")
    return part


def _check_header(name: str, path: str, reader, config: ModelConfig,
                  max_rank: int | None) -> None:
    """Every tensor's name, and each pair's shapes and rank, from the file's directory."""
    shapes: dict[tuple[int, str], dict[str, tuple[int, ...]]] = {}
    for tensor in reader.tensors:
        part = _part(name, path, tensor.name)
        base_name, _, half = tensor.name.rpartition(".")
        layer = int(canonical_name(base_name).split(".")[1])
        shapes.setdefault((layer, part), {})[half] = tuple(int(n) for n in reversed(tensor.shape))
    for (layer, part), pair in shapes.items():
        if set(pair) != {"lora_a", "lora_b"}:
            raise AdapterError(f"adapter {name}: layer {layer} {part} has "
                               f"{' and '.join(pair)} but not its other half")
        check_pair_shapes(name, layer, part, pair["lora_a"], pair["lora_b"], config, max_rank)

