"""A bfloat16 model's projections held as float8 (e4m3) on the generic backend's device
(`--gpu-fp8-weights`, issue 46; vLLM's `--quantization fp8`): half the bytes a decode step
reads for the weights, and the float8 tensor cores of a Hopper or Ada card for prefill.

The weight: one float32 scale per output row, max|w| / 448 (e4m3's largest finite value),
the row's codes w / scale rounded to e4m3. The activations: one scale per token, computed
each call the same way (dynamic, so no calibration). The product is torch._scaled_mm with
those row-wise scales and a bfloat16 out, which runs on the CPU too (how CI tests it:
tests/test_fp8_linear.py). A matrix whose sides are not multiples of 16 (torch._scaled_mm's
rule) stays dense."""
from __future__ import annotations

import torch

E4M3 = torch.float8_e4m3fn
E4M3_MAX = torch.finfo(E4M3).max  # 448
_ALIGN = 16


def fits(weight: torch.Tensor) -> bool:
    """Whether a [out, in] matrix can be held as float8: both sides multiples of 16."""
    return weight.dim() == 2 and weight.shape[0] % _ALIGN == 0 and weight.shape[1] % _ALIGN == 0


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[rows, cols] -> (e4m3 codes [rows, cols], float32 scales [rows, 1]): x / scale
    rounded to e4m3, scale = max|row| / 448 (an all-zero row: scale 1, codes 0)."""
    wide = x.float()
    amax = wide.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    return (wide / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3), scale


class Fp8Linear(torch.nn.Module):
    """y = x @ W.T (+ bias) with W as e4m3 codes and a scale per output row, x rounded to
    e4m3 per token; out in the activations' dtype."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        if not fits(weight):
            raise ValueError(f"float8 weights need sides that are multiples of {_ALIGN}, got "
                             f"{tuple(weight.shape)}")
        self.out_features, self.in_features = weight.shape
        codes, scale = quantize_rows(weight.detach())
        self.register_buffer("codes", codes)  # [out, in]: its .T is the column-major [in, out]
        self.register_buffer("scale", scale.reshape(1, -1).contiguous())  # [1, out]
        self.register_buffer("bias", None if bias is None else bias.detach().clone())

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The [out, in] matrix the product uses."""
        return (self.codes.float() * self.scale.reshape(-1, 1)).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        leading = x.shape[:-1]
        rows = x.reshape(-1, self.in_features)
        if rows.shape[0] == 0:
            return x.new_empty(*leading, self.out_features)
        codes, scale = quantize_rows(rows)
        out = torch._scaled_mm(codes, self.codes.T, scale_a=scale, scale_b=self.scale,
                               out_dtype=x.dtype if x.dtype != torch.float32 else torch.bfloat16)
        out = out.to(x.dtype).reshape(*leading, self.out_features)
        return out if self.bias is None else out.add_(self.bias)  # (in the out's dtype)


def check_fp8_weights(config, backend) -> None:
    """--gpu-fp8-weights: a bfloat16 model on the generic backend, on a card with float8
    products (compute capability 8.9: Ada, Hopper and later), without --gpu-4bit-weights."""
    if not config.gpu_fp8_weights:
        return
    if not backend.generic:
        raise ValueError("--gpu-fp8-weights needs --device cuda (or torch-cpu, the generic "
                         "path on the CPU)")
    if config.dtype != "bfloat16":
        raise ValueError("--gpu-fp8-weights needs --dtype bfloat16")
    if config.gpu_4bit_weights:
        raise ValueError("--gpu-fp8-weights and --gpu-4bit-weights exclude each other: "
                         "choose one form for the projections")
    if backend.device.startswith("cuda"):
        major, minor = torch.cuda.get_device_capability(backend.device)
        if (major, minor) < (8, 9):
            raise ValueError(f"--gpu-fp8-weights needs a GPU with float8 products (compute "
                             f"capability 8.9 or later); this one has {major}.{minor}")
