"""The element-wise parts of a decoder layer for the GPU, in Triton: the same three functions
as TorchLayerOps (torch_layer_ops.py, the reference), each one kernel launch instead of the
several small torch kernels each takes there. On a GPU a decode step of a small batch
is mostly such launches (BENCHMARKS.md, "The engine on an H200"), graphs or not.

Each computes in float32 and rounds once, when it stores; the reference rounds to the
activation dtype between its torch ops, so bfloat16 results may differ from it by an ulp.
An int8 KV cache gets its codes and row scales from the same kernel. On the CPU these run
under Triton's interpreter (tests/test_triton_layer_ops.py), which is how CI checks them.
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
def _round_half_even(y):
    """torch.round's rounding (ties to even), for |y| well below 2**22: the interpreter has no
    rint."""
    nearest = tl.floor(y + 0.5)
    tie_to_odd = ((nearest - y) == 0.5) & ((nearest - 2.0 * tl.floor(nearest * 0.5)) != 0.0)
    return tl.where(tie_to_odd, nearest - 1.0, nearest)


@triton.jit
def _store_row(cache_ptr, scales_ptr, row, scale_index, lo, hi, dims, ok, half,
               QUANTIZED: tl.constexpr):
    """One (slot, KV head) row of HEAD_DIM values, as halves lo and hi (float32): stored in the
    cache's dtype, or as int8 codes round(x / scale) with scale = max|x| / 127 (an all-zero
    row: scale 0), layer_cache.quantize_rows's rule."""
    if QUANTIZED:
        amax = tl.maximum(tl.max(tl.where(ok, tl.abs(lo), 0.0), axis=0),
                          tl.max(tl.where(ok, tl.abs(hi), 0.0), axis=0))
        # torch's 127 / amax is reciprocal(amax) * 127: the same two roundings, or a value
        # at a tie would round the other way; div_rn: IEEE on a GPU too.
        inverse = tl.where(amax > 0, tl.math.div_rn(1.0, tl.where(amax > 0, amax, 1.0)) * 127.0,
                           0.0)
        lo = tl.minimum(tl.maximum(_round_half_even(lo * inverse), -127.0), 127.0)
        hi = tl.minimum(tl.maximum(_round_half_even(hi * inverse), -127.0), 127.0)
        tl.store(scales_ptr + scale_index, tl.math.div_rn(amax, 127.0))
    tl.store(cache_ptr + row + dims, lo.to(cache_ptr.dtype.element_ty), mask=ok)
    tl.store(cache_ptr + row + half + dims, hi.to(cache_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _rope_write_kv(qkv_ptr, positions_ptr, cos_ptr, sin_ptr, q_ptr, key_ptr, value_ptr,
                   key_scales_ptr, value_scales_ptr,
                   slots_ptr, stride_qkv, stride_cos, stride_q, stride_slot,
                   NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                   HALF_P2: tl.constexpr, QUANTIZED: tl.constexpr):
    """One program per (token, head): a query head is rotated into q; a KV head's key is
    rotated and written with its value at the token's slot (QUANTIZED: as int8 codes with
    their row scales; the rotated key rounded to the activations' dtype first, as the
    reference's is)."""
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
        scale_index = slot * NUM_KV_HEADS + kv_head
        row = scale_index * HEAD_DIM
        if QUANTIZED:
            rotated_lo = rotated_lo.to(qkv_ptr.dtype.element_ty).to(tl.float32)
            rotated_hi = rotated_hi.to(qkv_ptr.dtype.element_ty).to(tl.float32)
        _store_row(key_ptr, key_scales_ptr, row, scale_index, rotated_lo, rotated_hi, dims, ok,
                   half, QUANTIZED)
        value = start + NUM_KV_HEADS * HEAD_DIM  # this KV head's value, after the keys
        v_lo = tl.load(value + dims, mask=ok, other=0.0).to(tl.float32)
        v_hi = tl.load(value + half + dims, mask=ok, other=0.0).to(tl.float32)
        _store_row(value_ptr, value_scales_ptr, row, scale_index, v_lo, v_hi, dims, ok, half,
                   QUANTIZED)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """[..., width] as [rows, width] with unit stride along the row."""
    x = x.reshape(-1, x.shape[-1])
    return x if x.stride(-1) == 1 else x.contiguous()


class TritonLayerOps:
    # A mixture of experts' small steps run their pairs on the device (models/moe_triton.py).
    routes_experts_on_device = True

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
        quantized = key_scales is not None
        if not all(t.is_contiguous() for t in (key_cache, value_cache)
                   + ((key_scales, value_scales) if quantized else ())):
            return TorchLayerOps.rope_write_kv(qkv, positions, cos, sin, key_cache, value_cache,
                                               slot_mapping, num_heads, key_scales, value_scales)
        qkv = _rows(qkv)
        num_tokens = qkv.shape[0]
        num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
        q = torch.empty(num_tokens, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
        if num_tokens == 0:
            return q
        _rope_write_kv[(num_tokens, num_heads + num_kv_heads)](
            qkv, positions, cos, sin, q, key_cache, value_cache,
            *((key_scales, value_scales) if quantized else (cos, sin)),  # (unread if not)
            slot_mapping, qkv.stride(0), cos.stride(0), q.stride(0), slot_mapping.stride(0),
            NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
            HALF_P2=triton.next_power_of_2(head_dim // 2), QUANTIZED=quantized)
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
