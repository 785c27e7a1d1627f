"""Fused projections, made by the loader: q, k and v as one matrix, gate and up as one, so
each is one GEMM. Dense weights and their 4-bit originals are fused alike (all parts or
none)."""
from __future__ import annotations

import torch

from pagedllm.weights.q4 import cat_4bit


def fuse_projections(weights: dict[str, torch.Tensor], num_layers: int) -> dict[str, torch.Tensor]:
    """Canonical q/k/v and gate/up weights -> the fused qkv_proj and gate_up_proj."""
    fused = dict(weights)
    for i in range(num_layers):
        attn, mlp = f"layers.{i}.self_attn.", f"layers.{i}.mlp."
        for kind in ("weight", "bias"):
            _fuse(fused, [f"{attn}{p}_proj.{kind}" for p in "qkv"], f"{attn}qkv_proj.{kind}")
        _fuse(fused, [f"{mlp}gate_proj.weight", f"{mlp}up_proj.weight"], f"{mlp}gate_up_proj.weight")
    return fused


def _fuse(weights: dict, parts: list[str], name: str, cat=torch.cat) -> None:
    """The parts concatenated under `name` where all are there; otherwise left as they are
    (the model builder stacks parts kept in different formats: models/low_bit.py)."""
    if all(part in weights for part in parts):
        weights[name] = cat([weights.pop(part) for part in parts])


def fuse_experts(weights: dict[str, torch.Tensor], num_layers: int,
                 num_experts: int) -> dict[str, torch.Tensor]:
    """Each layer's experts stacked: mlp.experts_gate_up [E, 2I, H] (gate rows, then up) and
    mlp.experts_down [E, H, I], so the MoE layer indexes one tensor per expert."""
    fused = dict(weights)
    for i in range(num_layers):
        mlp, prefix = f"layers.{i}.mlp.", f"layers.{i}.mlp.experts."
        if f"{mlp}experts_gate" in fused:  # GGUF: already stacked, gate and up apart
            fused[f"{mlp}experts_gate_up"] = torch.cat([fused.pop(f"{mlp}experts_gate"),
                                                       fused.pop(f"{mlp}experts_up")], dim=1)
            continue
        if f"{prefix}0.down_proj.weight" not in fused:
            continue  # kept as codes (models/low_bit.py), or missing: the model says which
        try:
            gate_up = [torch.cat([fused.pop(f"{prefix}{e}.gate_proj.weight"),
                                  fused.pop(f"{prefix}{e}.up_proj.weight")])
                       for e in range(num_experts)]
            down = [fused.pop(f"{prefix}{e}.down_proj.weight") for e in range(num_experts)]
        except KeyError as exc:
            raise ValueError(f"weights do not fit the model: missing {exc.args[0]}") from exc
        fused[f"layers.{i}.mlp.experts_gate_up"] = torch.stack(gate_up)
        fused[f"layers.{i}.mlp.experts_down"] = torch.stack(down)
    return fused


def fuse_quantized(quantized: dict, num_layers: int, cat=cat_4bit) -> dict:
    """4-bit q/k/v and gate/up weights -> fused, like fuse_projections (all parts or none).
    cat: how parts join (plan counts parameters through the same rule: cat=sum)."""
    fused = dict(quantized)
    for i in range(num_layers):
        attn, mlp = f"layers.{i}.self_attn.", f"layers.{i}.mlp."
        _fuse(fused, [f"{attn}{p}_proj.weight" for p in "qkv"], f"{attn}qkv_proj.weight", cat)
        _fuse(fused, [f"{mlp}gate_proj.weight", f"{mlp}up_proj.weight"], f"{mlp}gate_up_proj.weight",
              cat)
    return fused
