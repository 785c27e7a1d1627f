"""The GPU's layer ops in Triton (backends/triton_layer_ops.py) against the torch reference
(backends/torch_layer_ops.py), here under Triton's interpreter (on a GPU compiled:
scripts/gpu_check.sh runs this file with PAGEDLLM_TEST_DEVICE=cuda): float32 to float
rounding, bfloat16 within its rounding, the KV rows at their slots and nowhere else."""
from __future__ import annotations

from gpu_path import ON, skip_without_the_gpu

import pytest  # noqa: E402
import torch  # noqa: E402

from pagedllm.backends.torch_layer_ops import TorchLayerOps  # noqa: E402
from pagedllm.backends.triton_layer_ops import TritonLayerOps  # noqa: E402

skip_without_the_gpu()
# float32: summation order only; bfloat16: four ulps (the reference rounds between its ops,
# and Triton's interpreter rounds toward zero where a GPU rounds to nearest)
RELATIVE = {torch.float32: 1e-5, torch.bfloat16: 2 ** -5}


def close(got: torch.Tensor, want: torch.Tensor) -> bool:
    bound = RELATIVE[want.dtype] * want.float().abs().clamp(min=1.0)
    return bool(((got.float() - want.float()).abs() <= bound).all())


def rand(*shape, dtype=torch.float32, seed=0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 1.5).to(dtype).to(ON)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden", [64, 576, 100])
def test_rms_norm_with_and_without_a_residual(dtype, hidden):
    x, weight = rand(7, hidden, dtype=dtype), rand(hidden, dtype=dtype, seed=1)
    want = TorchLayerOps.rms_norm(x.clone(), None, weight, 1e-5)
    got = TritonLayerOps.rms_norm(x.clone(), None, weight, 1e-5)
    assert got.dtype == dtype and close(got, want)
    residual = rand(7, hidden, dtype=dtype, seed=2)
    theirs, ours = residual.clone(), residual.clone()
    want = TorchLayerOps.rms_norm(x, theirs, weight, 1e-5)
    got = TritonLayerOps.rms_norm(x, ours, weight, 1e-5)
    assert close(ours, theirs)  # added in place
    assert close(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul(dtype):
    gate_up = rand(5, 2 * 1536, dtype=dtype)
    want, got = TorchLayerOps.silu_and_mul(gate_up), TritonLayerOps.silu_and_mul(gate_up)
    assert got.shape == (5, 1536) and got.dtype == dtype
    assert close(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 16), (9, 3, 64), (2, 1, 80)])
def test_rope_and_kv_written_at_their_slots(dtype, heads, kv_heads, head_dim):
    tokens, blocks, block_size = 5, 6, 4
    qkv = rand(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype)
    positions = torch.tensor([0, 1, 7, 30, 3], device=ON)
    angles = torch.arange(64).float().unsqueeze(1) * torch.rand(head_dim // 2) * 0.3
    cos = torch.cat([angles.cos(), angles.cos()], -1).to(ON)
    sin = torch.cat([angles.sin(), angles.sin()], -1).to(ON)
    slots = torch.tensor([3, 9, 0, 22, 17], device=ON)
    caches = {}
    for ops in (TorchLayerOps, TritonLayerOps):
        key = torch.full((blocks, block_size, kv_heads, head_dim), 7.0, dtype=dtype, device=ON)
        value = key.clone()
        q = ops.rope_write_kv(qkv, positions, cos, sin, key, value, slots, heads)
        caches[ops] = (q, key, value)
    for want, got in zip(caches[TorchLayerOps], caches[TritonLayerOps]):
        assert got.shape == want.shape and got.dtype == dtype and close(got, want)
    untouched = torch.ones(blocks * block_size, dtype=torch.bool)
    untouched[slots.cpu()] = False
    key = caches[TritonLayerOps][1].view(-1, kv_heads, head_dim)
    assert (key[untouched.to(ON)] == 7.0).all()  # no other slot written


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(2, 1, 16), (9, 3, 64), (4, 2, 80)])
def test_an_int8_cache_gets_the_references_codes_and_scales(dtype, heads, kv_heads, head_dim):
    """Rotated keys and values written as int8 codes with their row scales at their slots:
    values exactly the reference's codes and scales (the same rounding, ties to even: one
    value row is made of ties); keys exactly in float32 under the interpreter, else within
    a code or two (below), and q as the float cache's test holds it."""
    tokens, blocks, block_size = 4, 6, 4
    qkv = rand(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype, seed=head_dim)
    ties = torch.tensor([127.0, 2.5, -1.5, 0.5, -0.5, 3.5, -126.5, 0.0] * (head_dim // 8))
    qkv[1, -head_dim:] = ties.to(dtype).to(ON)  # the last value head of token 1: all ties
    qkv[2, (heads + kv_heads) * head_dim:] = 0.0  # token 2's values all zero: scale 0
    positions = torch.tensor([0, 3, 9, 30], device=ON)
    angles = torch.arange(64).float().unsqueeze(1) * torch.rand(head_dim // 2) * 0.3
    cos = torch.cat([angles.cos(), angles.cos()], -1).to(ON)
    sin = torch.cat([angles.sin(), angles.sin()], -1).to(ON)
    slots = torch.tensor([3, 9, 0, 22], device=ON)
    written = {}
    for ops in (TorchLayerOps, TritonLayerOps):
        key = torch.full((blocks, block_size, kv_heads, head_dim), 99, dtype=torch.int8,
                         device=ON)
        value = key.clone()
        key_scales = torch.full((blocks, block_size, kv_heads), -1.0, device=ON)
        value_scales = key_scales.clone()
        q = ops.rope_write_kv(qkv, positions, cos, sin, key, value, slots, heads, key_scales,
                              value_scales)
        written[ops] = (q, key, value, key_scales, value_scales)
    (q0, k0, v0, ks0, vs0), (q1, k1, v1, ks1, vs1) = written.values()
    assert close(q1, q0)
    if ON == "cpu":  # the interpreter rounds as numpy does: as torch does
        assert torch.equal(v1, v0) and torch.equal(vs1, vs0)
    else:  # a GPU's division and multiply-adds may land a value at a tie the other side
        assert (v1.int() - v0.int()).abs().max() <= 1 and torch.allclose(vs1, vs0, rtol=1e-6)
    assert v1.view(-1, kv_heads, head_dim)[9, -1, :8].tolist() == [127, 2, -2, 0, 0, 4, -126, 0]
    assert (vs1.view(-1, kv_heads)[0] == 0).all()
    if dtype == torch.float32 and ON == "cpu":
        assert torch.equal(k1, k0) and torch.equal(ks1, ks0)
    else:  # bfloat16: the reference's rotation rounds three times (up to ~0.6 % of 127
        # codes apart), this one's once; on a GPU float32 multiply-adds fuse (a code at most)
        assert (k1.int() - k0.int()).abs().max() <= (2 if dtype == torch.bfloat16 else 1)
        assert torch.allclose(ks1, ks0, rtol=2 ** -6)
    untouched = torch.ones(blocks * block_size, dtype=torch.bool)
    untouched[slots.cpu()] = False
    assert (k1.view(-1, kv_heads, head_dim)[untouched.to(ON)] == 99).all()
    assert (vs1.view(-1, kv_heads)[untouched.to(ON)] == -1.0).all()
