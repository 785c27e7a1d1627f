"""One layer's paged K/V tensors, in the model's dtype or as int8 codes with scales.

`kv_cache_dtype="auto"` keeps K and V in the model's dtype. `"int8"` stores each (token, KV
head) row as int8 codes round(x / scale) with its own float32 scale, max|x| / 127: per token
1 byte an element plus 4 bytes a row, 53 % of bfloat16 for head_dim 64. The C++ kernels
read the codes directly (decode attention multiplies them as integers, the way llama.cpp
uses a q8_0 cache); the torch paths below dequantize what they gather.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from pagedllm.config import KV_CACHE_DTYPES


class LayerKVCache(NamedTuple):
    """key, value: [num_blocks, block_size, kv_heads, head_dim]; the scales
    [num_blocks, block_size, kv_heads] float32 when int8, else None."""
    key: torch.Tensor
    value: torch.Tensor
    key_scale: torch.Tensor | None = None
    value_scale: torch.Tensor | None = None

    @property
    def quantized(self) -> bool:
        return self.key_scale is not None

    def keys(self, index) -> torch.Tensor:
        """The key rows at index (of the block dimension), dequantized to float32 when int8."""
        return _dequantize(self.key[index], None if self.key_scale is None else self.key_scale[index])

    def values(self, index) -> torch.Tensor:
        return _dequantize(self.value[index], None if self.value_scale is None else self.value_scale[index])


def allocate_layer_caches(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                          head_dim: int, dtype: torch.dtype, kv_cache_dtype: str = "auto",
                          device: str = "cpu") -> list[LayerKVCache]:
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    # torch.empty maps fresh pages without touching them: memory becomes resident only as
    # blocks are first written, so a generous pool costs nothing until it is used (on the
    # host; a GPU's pool is allocated whole).
    if kv_cache_dtype == "int8":
        return [LayerKVCache(torch.empty(shape, dtype=torch.int8, device=device),
                             torch.empty(shape, dtype=torch.int8, device=device),
                             torch.empty(shape[:3], device=device),
                             torch.empty(shape[:3], device=device))
                for _ in range(num_layers)]
    return [LayerKVCache(torch.empty(shape, dtype=dtype, device=device),
                         torch.empty(shape, dtype=dtype, device=device))
            for _ in range(num_layers)]


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., D] -> (int8 codes [..., D], float32 scales [...]): round(x / scale), scale =
    max|x| / 127 per row (an all-zero row: scale 0, codes 0). The C++ writer's rule."""
    x = x.float()
    amax = x.abs().amax(dim=-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    codes = (x * inv).clamp(-127, 127).round().to(torch.int8)
    return codes, (amax / 127.0).squeeze(-1)


def _dequantize(codes: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    if scale is None:
        return codes
    return codes.float() * scale.unsqueeze(-1)
