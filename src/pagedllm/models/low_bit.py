"""The bfloat16 model's projections, embedding and output head straight from a GGUF's
quantized matrices (weights/gguf_original.py), where the C++ kernels run: 4-bit types
(Q4_0, Q4_1, Q4_K) as 4-bit codes (QuantLinear), Q6_K as 6-bit codes (Q6Linear), the others
as 8-bit codes (Q8Linear; Q8_0 as it is, Q5_* and the i-quants rounded to it), a fused
projection of mixed parts as a StackedLinear. What is kept here is never dequantized to a
float copy, so a Q4_K_M model takes about its file's size in memory. Everything else runs
dense (build.py).
"""
from __future__ import annotations

import contextlib
from itertools import groupby

import torch
from torch import nn

from pagedllm.model_config import ModelConfig
from pagedllm.models.output_head import TILE  # the low-bit kernels' rows per tile
from pagedllm.models.quant_linear import DenseLinear, Q6Linear, Q8Linear, QuantLinear, StackedLinear
from pagedllm.weights.gguf_original import GGUFOriginal
from pagedllm.weights.q4 import cat_4bit
from pagedllm.weights.q6 import Q6Weight
from pagedllm.weights.q8 import Q8Rows

EMBEDDING_NAMES = ("embed_tokens.weight", "lm_head.weight")
# Each layer's fused projections and the checkpoint parts they are made of (a checkpoint may
# hold the fused matrix itself, as Phi-3's does).
FUSED_PROJECTIONS = (("self_attn", "qkv_proj", ("q_proj", "k_proj", "v_proj")),
                     ("self_attn", "o_proj", ()),
                     ("mlp", "gate_up_proj", ("gate_proj", "up_proj")),
                     ("mlp", "down_proj", ()))
_PROJECTION_NAMES = {(part, name) for part, fused, parts in FUSED_PROJECTIONS
                     for name in (fused, *parts)}
# A mixture of experts' stacked matrices [experts, rows, cols], as a GGUF names them.
EXPERT_NAMES = ("experts_gate", "experts_up", "experts_down")


def kept_originals(config: ModelConfig, quantized: dict, ops) -> dict[str, GGUFOriginal]:
    """The quantized matrices the kernels `ops` (None: no kernels) take as codes: projections
    and the embedding / output head, in whole tiles of rows. A partial-rotary model's q/k/v
    rows are permuted (build.py), so those run dense."""
    if ops is None:
        return {}
    kept = {}
    for name, original in quantized.items():
        if not isinstance(original, GGUFOriginal) or original.shape[-2] % TILE:
            continue
        parts = name.split(".")
        if len(parts) == 4 and parts[2] == "mlp" and parts[3] in EXPERT_NAMES:
            kept[name] = original
            continue
        projection = (len(parts) == 5 and parts[0] == "layers" and parts[4] == "weight"
                      and (parts[2], parts[3]) in _PROJECTION_NAMES)
        if projection and config.rotary_dim and parts[2] == "self_attn" and parts[3] != "o_proj":
            continue
        if projection or name in EMBEDDING_NAMES:
            kept[name] = original
    # A layer's experts are kept all three or not at all (gate rows in whole tiles, down not).
    for name in [n for n in kept if n.rsplit(".", 1)[-1] in EXPERT_NAMES]:
        prefix = name.rsplit(".", 1)[0] + "."
        if not all(prefix + part in kept for part in EXPERT_NAMES):
            del kept[name]
    return kept


def install_projections(model: nn.Module, kept: dict[str, GGUFOriginal], dense: dict,
                        int8_layers: set[int], backend) -> None:
    """Replaces each projection with a kept part by its low-bit module; dense parts and biases
    it takes are popped from `dense`. int8_layers: layers whose 4-bit projections may round
    activations to int8 (QuantLinear)."""
    for i, layer in enumerate(model.layers):
        for part, fused, parts in FUSED_PROJECTIONS:
            prefix = f"layers.{i}.{part}."
            names = [fused] if f"{prefix}{fused}.weight" in kept or not parts else list(parts)
            if not any(f"{prefix}{n}.weight" in kept for n in names):
                continue  # all dense: loaded as it is
            sources = [_source(kept, dense, f"{prefix}{n}.weight") for n in names]
            bias = dense.pop(f"{prefix}{fused}.bias", None)
            setattr(getattr(layer, part), fused,
                    _module(sources, bias, i in int8_layers, backend))
        _install_experts(layer.mlp, kept, f"layers.{i}.mlp.", i in int8_layers, backend)


def _install_experts(mlp: nn.Module, kept: dict, prefix: str, int8: bool, backend) -> None:
    """A mixture of experts whose stacked matrices are all kept: each expert's gate and up
    as one low-bit module (stacked if their formats differ), its down as another."""
    gate, up, down = (kept.get(prefix + name) for name in EXPERT_NAMES)
    if gate is None or up is None or down is None:
        return
    mlp.use_expert_modules([
        (_module([_source_of(gate.expert(e)), _source_of(up.expert(e))], None, int8, backend),
         _module([_source_of(down.expert(e))], None, int8, backend))
        for e in range(down.shape[0])])


def _source(kept: dict, dense: dict, name: str) -> tuple[str, object]:
    original = kept.get(name)
    return ("dense", dense.pop(name)) if original is None else _source_of(original)


def _source_of(original: GGUFOriginal) -> tuple[str, object]:
    if original.four_bit:
        return "q4", original.q4()
    return ("q6", original.q6()) if original.six_bit else ("q8", original.q8())


def _module(sources: list, bias, int8_activations: bool, backend) -> nn.Module:
    groups = [(kind, [weight for _, weight in group])
              for kind, group in groupby(sources, key=lambda source: source[0])]
    if len(groups) == 1 and groups[0][0] != "dense":  # one format: one module, its own bias
        return _part(*groups[0], bias, int8_activations, backend)
    return StackedLinear([_part(kind, weights, None, int8_activations, backend)
                          for kind, weights in groups], bias)


def _part(kind: str, weights: list, bias, int8_activations: bool, backend):
    if kind == "q4":
        return QuantLinear(None, bias, cat_4bit(weights), backend, int8_activations=int8_activations)
    if kind == "q6":
        return Q6Linear(Q6Weight.cat(weights), bias, backend.kernels, backend)
    if kind == "q8":
        return Q8Linear(Q8Rows.cat(weights), bias, backend.kernels, backend)
    return DenseLinear(torch.cat(weights).to(torch.bfloat16), bias, backend)


@contextlib.contextmanager
def uninitialised_linears():
    """Linear layers built inside skip drawing random weights: the checkpoint's replace them,
    and drawing would write (make resident) every page of matrices that low-bit modules
    replace before they are ever read."""
    reset = nn.Linear.reset_parameters
    nn.Linear.reset_parameters = lambda self: None
    try:
        yield
    finally:
        nn.Linear.reset_parameters = reset
