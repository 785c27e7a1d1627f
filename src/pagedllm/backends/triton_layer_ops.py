"""The element-wise parts of a decoder layer for the GPU, in Triton: the same three functions
as TorchLayerOps (torch_layer_ops.py, the reference), each one kernel launch instead of the
several small torch kernels each takes there. On a GPU a decode step of a small batch
is mostly such launches (BENCHMARKS.md, "The engine on an H200"), graphs or not.

Each computes in float32 and rounds once, when it stores; the reference rounds to the
activation dtype between its torch ops, so bfloat16 results may differ from it by an ulp.
An int8 KV cache takes the reference's rope_write_kv. On the CPU these run under Triton's
interpreter (tests/test_triton_layer_ops.py), which is how CI checks them.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.backends.torch_layer_ops import TorchLayerOps


@triton.jit
def _rms_norm(x_ptr, res_ptr, w_ptr, out_ptr, hidden, eps, stride_x, stride_r, stride_o,
              HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    ok = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:  # residual += x, in place, in its dtype; the norm reads the sum
        total = x + tl.load(res_ptr + row * stride_r + cols, mask=ok, other=0.0).to(tl.float32)
        stored = total.to(res_ptr.dtype.element_ty)
        tl.store(res_ptr + row * stride_r + cols, stored, mask=ok)
        x = stored.to(tl.float32)
    inverse = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / hidden + eps)
    weight = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (weight * (x * inverse)).to(out_ptr.dtype.element_ty),
             mask=ok)


@triton.jit
def _silu_and_mul(gate_up_ptr, out_ptr, width, stride_g, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < width
    gate = tl.load(gate_up_ptr + row * stride_g + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * stride_g + width + cols, mask=ok, other=0.0).to(tl.float32)
    silu = gate / (1.0 + tl.exp(-gate))
    tl.store(out_ptr + row * stride_o + cols, (silu * up).to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _rope_write_kv(qkv_ptr, positions_ptr, cos_ptr, sin_ptr, q_ptr, key_ptr, value_ptr,
                   slots_ptr, stride_qkv, stride_cos, stride_q, stride_slot,
                   NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                   HALF_P2: tl.constexpr):
    """One program per (token, head): a query head is rotated into q; a KV head's key is
    rotated and written with its value at the token's slot."""
    token = tl.program_id(0)
    head = tl.program_id(1)
    half = HEAD_DIM // 2
    dims = tl.arange(0, HALF_P2)
    ok = dims < half
    position = tl.load(positions_ptr + token)
    cos_lo = tl.load(cos_ptr + position * stride_cos + dims, mask=ok, other=0.0)
    cos_hi = tl.load(cos_ptr + position * stride_cos + half + dims, mask=ok, other=0.0)
    sin_lo = tl.load(sin_ptr + position * stride_cos + dims, mask=ok, other=0.0)
    sin_hi = tl.load(sin_ptr + position * stride_cos + half + dims, mask=ok, other=0.0)
    start = qkv_ptr + token * stride_qkv + head * HEAD_DIM  # q heads, then k heads, then v
    lo = tl.load(start + dims, mask=ok, other=0.0).to(tl.float32)
    hi = tl.load(start + half + dims, mask=ok, other=0.0).to(tl.float32)
    rotated_lo = lo * cos_lo - hi * sin_lo
    rotated_hi = hi * cos_hi + lo * sin_hi
    if head < NUM_HEADS:
        out = q_ptr + token * stride_q + head * HEAD_DIM
        tl.store(out + dims, rotated_lo.to(q_ptr.dtype.element_ty), mask=ok)
        tl.store(out + half + dims, rotated_hi.to(q_ptr.dtype.element_ty), mask=ok)
    else:
        kv_head = head - NUM_HEADS
        slot = tl.load(slots_ptr + token * stride_slot).to(tl.int64)
        row = (slot * NUM_KV_HEADS + kv_head) * HEAD_DIM
        tl.store(key_ptr + row + dims, rotated_lo.to(key_ptr.dtype.element_ty), mask=ok)
        tl.store(key_ptr + row + half + dims, rotated_hi.to(key_ptr.dtype.element_ty), mask=ok)
        value = start + NUM_KV_HEADS * HEAD_DIM  # this KV head's value, after the keys
        v_lo = tl.load(value + dims, mask=ok, other=0.0)
        v_hi = tl.load(value + half + dims, mask=ok, other=0.0)
        tl.store(value_ptr + row + dims, v_lo.to(value_ptr.dtype.element_ty), mask=ok)
        tl.store(value_ptr + row + half + dims, v_hi.to(value_ptr.dtype.element_ty), mask=ok)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """[..., width] as [rows, width] with unit stride along the row."""
    x = x.reshape(-1, x.shape[-1])
    return x if x.stride(-1) == 1 else x.contiguous()


class TritonLayerOps:
    @staticmethod
    def rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> torch.Tensor:
        rows = _rows(x)
        out = torch.empty_like(rows)
        if rows.shape[0] == 0:
            return out.view(x.shape)
        res = residual.view(-1, residual.shape[-1]) if residual is not None else rows
        if residual is not None and (res.stride(-1) != 1 or not residual.is_contiguous()):
            raise ValueError("rms_norm: the residual must be contiguous (it is added in place)")
        hidden = rows.shape[1]
        _rms_norm[(rows.shape[0],)](rows, res, weight, out, hidden, eps, rows.stride(0),
                                    res.stride(0), out.stride(0),
                                    HAS_RESIDUAL=residual is not None,
                                    BLOCK=triton.next_power_of_2(hidden))
        return out.view(x.shape)

    @staticmethod
    def rope_write_kv(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                      sin: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                      slot_mapping: torch.Tensor, num_heads: int,
                      key_scales: torch.Tensor | None = None,
                      value_scales: torch.Tensor | None = None) -> torch.Tensor:
        if key_scales is not None or not (key_cache.is_contiguous() and value_cache.is_contiguous()):
            return TorchLayerOps.rope_write_kv(qkv, positions, cos, sin, key_cache, value_cache,
                                               slot_mapping, num_heads, key_scales, value_scales)
        qkv = _rows(qkv)
        num_tokens = qkv.shape[0]
        num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
        q = torch.empty(num_tokens, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
        if num_tokens == 0:
            return q
        _rope_write_kv[(num_tokens, num_heads + num_kv_heads)](
            qkv, positions, cos, sin, q, key_cache, value_cache, slot_mapping,
            qkv.stride(0), cos.stride(0), q.stride(0), slot_mapping.stride(0),
            NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
            HALF_P2=triton.next_power_of_2(head_dim // 2))
        return q

    @staticmethod
    def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
        rows = _rows(gate_up)
        width = rows.shape[1] // 2
        out = torch.empty(rows.shape[0], width, dtype=rows.dtype, device=rows.device)
        if rows.shape[0]:
            block = min(1024, triton.next_power_of_2(width))
            _silu_and_mul[(rows.shape[0], triton.cdiv(width, block))](
                rows, out, width, rows.stride(0), out.stride(0), BLOCK=block)
        return out.view(*gate_up.shape[:-1], width)
