"""One LoRA adapter in the model's fused layout, whatever file it came from.

A LoRA module adds B @ A to a projection's weight: A [r, in] and B [out, r], scaled by
alpha / r (alpha / sqrt(r) with rsLoRA). The model multiplies q, k and v as one matrix and
gate and up as one (weights/fuse.py), so an adapter is kept per fused projection, as its
parts in the fused rows' order (None where it leaves a part alone): the slots (slots.py)
stack the parts' A rows, one product for them all, and give each part's B its own columns
of the output. The scale is folded into B once, so the step multiplies x @ A.T @ B.T and
nothing else, and parts with different ranks or alphas (PEFT's rank_pattern) need no
special case.
"""
from __future__ import annotations

import dataclasses
import hashlib
import math
from dataclasses import dataclass

import torch

from pagedllm.model_config import ModelConfig
from pagedllm.errors import AdapterError

# The fused projections an adapter may touch, with their checkpoint parts in row order.
FUSED_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
               "gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}
PART_TO_FUSED = {part: fused for fused, parts in FUSED_PARTS.items() for part in parts}
# The largest |alpha / rank| (or alpha / sqrt(rank), rsLoRA) an adapter may scale its product
# by: trained adapters use 0.1-32; a scale near float32's range (lora_alpha 1e38) turned
# every output into infinities and the answers empty.
MAX_SCALE = 1000.0
# Where each fused projection sits in a decoder layer.
MODULE_OWNER = {"qkv_proj": "self_attn", "o_proj": "self_attn", "gate_up_proj": "mlp",
                "down_proj": "mlp"}


def part_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) of every part an adapter may target, for this base model."""
    h, q, kv = config.hidden_size, config.num_heads * config.head_dim, \
        config.num_kv_heads * config.head_dim
    i = config.intermediate_size
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}


@dataclass
class PartWeights:
    """One checkpoint part's adapter: A [r, in], B [out, r], its scale not yet folded."""

    a: torch.Tensor
    b: torch.Tensor
    scale: float


@dataclass(frozen=True)
class FusedWeights:
    """A fused projection's adapter: per part, in the fused rows' order, A [r, in] and
    B [out_part, r] with the scale folded in (float32); None where the adapter leaves it."""

    parts: tuple[tuple[torch.Tensor, torch.Tensor] | None, ...]

    @property
    def rank(self) -> int:
        return max(a.shape[0] for a, _ in filter(None, self.parts))

    @property
    def num_bytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in filter(None, self.parts))


@dataclass
class LoRAAdapter:
    name: str
    path: str
    source: str  # "peft" or "gguf"
    rank: int  # the largest rank of any of its parts
    alpha: float
    targets: tuple[str, ...]  # the checkpoint parts it changes (q_proj, ...)
    modules: dict[tuple[int, str], FusedWeights]  # (layer, fused projection) -> weights
    key: str = ""  # name + digest of its weights: the prefix cache's key, never reused
    num_bytes: int = 0  # its weights' size (kept in a description without them)

    def described(self) -> LoRAAdapter:
        """This adapter without its weights: what a front end that checks and lists
        adapters keeps, while the engine holds the weights (serving/front_adapters.py)."""
        return dataclasses.replace(self, modules={})


def lora_rank(name: str, where: str, a: torch.Tensor) -> int:
    """The rank of a part's A [rank, fan_in]: its scale divides by it, so a rank of 0 (or an
    A that is not a matrix) is refused here, before any scale is computed."""
    if a.dim() != 2 or a.shape[0] == 0:
        raise AdapterError(f"adapter {name}: {where} has A {tuple(a.shape)}: a LoRA A is a "
                           f"[rank, inputs] matrix of rank 1 or more")
    return a.shape[0]


def check_pair_shapes(name: str, layer: int, part: str, a_shape: tuple[int, ...],
                      b_shape: tuple[int, ...], config: ModelConfig, max_rank: int | None) -> int:
    """A part's A and B shapes against the base model and the rank limit, before (from a
    file's header) and after reading it; returns the rank. AdapterError says what is wrong."""
    where = f"layer {layer} {part}"
    if not 0 <= layer < config.num_layers:
        raise AdapterError(f"adapter {name} has weights for layer {layer}; the base model "
                           f"has {config.num_layers} layers: it was made for another model")
    if len(a_shape) != 2 or a_shape[0] == 0:
        raise AdapterError(f"adapter {name}: {where} has A {tuple(a_shape)}: a LoRA A is a "
                           f"[rank, inputs] matrix of rank 1 or more")
    rank = a_shape[0]
    if len(b_shape) != 2 or b_shape[1] != rank:
        raise AdapterError(f"adapter {name}: {where} has A {tuple(a_shape)} and B "
                           f"{tuple(b_shape)}, which do not make a LoRA pair")
    fan_in, fan_out = part_shapes(config)[part]
    if a_shape[1] != fan_in or b_shape[0] != fan_out:
        raise AdapterError(f"adapter {name}: {where} is {b_shape[0]}x{a_shape[1]} in the adapter "
                           f"(B {tuple(b_shape)}, A {tuple(a_shape)}) but {fan_out}x{fan_in} in "
                           f"the base model: it was made for another model")
    if max_rank is not None and rank > max_rank:
        raise AdapterError(f"adapter {name} has rank {rank}, above this server's "
                           f"--max-lora-rank {max_rank}")
    return rank


def build_adapter(name: str, path: str, source: str, alpha: float,
                  parts: dict[tuple[int, str], PartWeights], config: ModelConfig,
                  max_rank: int | None) -> LoRAAdapter:
    """Parts read from a file -> the fused adapter, checked against the base's shapes."""
    if not parts:
        raise AdapterError(f"adapter {name} ({path}) holds no LoRA weights")
    if config.num_experts and any(PART_TO_FUSED[p] in ("gate_up_proj", "down_proj")
                                  for _, p in parts):
        raise AdapterError(f"adapter {name} changes the MLP of a mixture-of-experts model, "
                           f"which pagedllm does not apply LoRA to yet")
    if config.rotary_dim:
        raise AdapterError(f"adapter {name}: LoRA on a partial-rotary model "
                           f"({config.architecture}) is not supported yet")
    rank = 0
    for (layer, part), w in parts.items():
        where = f"layer {layer} {part}"
        if not (w.a.is_floating_point() and w.b.is_floating_point()):
            raise AdapterError(f"adapter {name}: {where} holds {w.a.dtype} / {w.b.dtype} "
                               f"weights; LoRA weights are floating point")
        if not math.isfinite(w.scale) or abs(w.scale) > MAX_SCALE:
            raise AdapterError(f"adapter {name}: {where}'s scale (alpha / rank) is {w.scale!r}; "
                               f"pagedllm serves scales of at most {MAX_SCALE:g} in magnitude")
        r = check_pair_shapes(name, layer, part, tuple(w.a.shape), tuple(w.b.shape), config,
                              max_rank)
        if not (torch.isfinite(w.a).all() and torch.isfinite(w.b).all()):
            raise AdapterError(f"adapter {name}: {where} holds values that are not finite")
        rank = max(rank, r)
    modules = {}
    for layer, fused in sorted({(layer, PART_TO_FUSED[part]) for layer, part in parts}):
        modules[(layer, fused)] = FusedWeights(tuple(
            None if (w := parts.get((layer, p))) is None
            else (w.a.float().contiguous(), (w.b.float() * w.scale).contiguous())
            for p in FUSED_PARTS[fused]))
    adapter = LoRAAdapter(name, path, source, rank, alpha,
                          tuple(sorted({part for _, part in parts})), modules)
    adapter.key = f"{name}@{_digest(modules)}"
    adapter.num_bytes = sum(w.num_bytes for w in modules.values())
    return adapter


def _digest(modules: dict[tuple[int, str], FusedWeights]) -> str:
    digest = hashlib.sha256()
    for key in sorted(modules):
        digest.update(repr(key).encode())
        for part in modules[key].parts:
            for tensor in part or ():
                digest.update(tensor.numpy().tobytes())
            digest.update(b"|")
    return digest.hexdigest()[:16]
