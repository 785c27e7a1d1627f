"""Few-row 4-bit products with the activations held as 16-bit integers (q4_i16_gemm,
kernels/lowbit_gemm.h: split_rows): against a float64 reference that rounds the activations
the same way, at every layout; row independence, scaling by powers of two, non-finite
inputs, at every level with an int16 tile (avx2, avx512) this host runs; the fallback to the
exact product on the portable level; q4_linear's choice by rows; and the run-time decision
(kernels/cpu.py: every CPU at avx2, Intel at avx512, PAGEDLLM_CPU_INT16) as the layers and
the C++ decode loop take it."""
import dataclasses

import pytest
import torch

from pagedllm.backends import cpu_backend
from pagedllm.kernels import capabilities, cpu, kernels_for
from pagedllm.models.quant_linear import (ALL_ROWS, AMX_EXACT_MIN_ROWS, INT16_MAX_ROWS,
                                          QuantLinear, q4_exact_max_rows)
from pagedllm.weights.q4 import Q4Weight
from test_amx import q4_1, q4_k

INT16_LEVELS = [level for level in cpu.INT16_LEVELS if level in capabilities().available]


def q4_0(rows: int, cols: int, seed: int = 0) -> Q4Weight:
    g = torch.Generator().manual_seed(seed)
    d = (torch.rand(rows, cols // 32, generator=g) * 0.02).half().float()
    return Q4Weight(torch.randint(0, 16, (rows, cols), generator=g, dtype=torch.uint8), d, -8 * d)


def split_reference(x: torch.Tensor) -> torch.Tensor:
    """The activations as split_rows rounds them, float64: per group of 32, a power of two
    maps the largest value's binade to [2^13, 2^14), the values round half to even there."""
    groups = x.float().reshape(x.shape[0], -1, 32)
    top = groups.abs().amax(-1, keepdim=True)
    exponent = (top.view(torch.int32) >> 23).double()  # biased, as the kernel reads it
    up = torch.pow(2.0, torch.clamp(267 - exponent, max=254) - 127)
    return (torch.round(groups.double() * up) / up).reshape(x.shape)


def product_error(out: torch.Tensor, reference: torch.Tensor, x: torch.Tensor,
                  w: torch.Tensor) -> torch.Tensor:
    """|out - reference| over what bfloat16 output rounding and float32 sums allow."""
    allowed = reference.abs() * 2.0 ** -8 + (x.double().abs() @ w.double().abs().T) * 1e-6
    return (out.double() - reference).abs() / allowed


@pytest.fixture(scope="module", params=INT16_LEVELS or [pytest.param(None, marks=pytest.mark.skip(
    reason="this host runs no level with an int16 tile (avx2, avx512)"))])
def avx512(request):
    """The kernels of each level with an int16 tile (the name kept from when avx512 alone had
    one)."""
    module = kernels_for(request.param)
    assert module.int16_tiles_built()
    return module


@pytest.mark.parametrize("make, shape", [(q4_0, (32, 64)), (q4_1, (48, 576)), (q4_k, (48, 512)),
                                         (q4_k, (64, 1536))])
@pytest.mark.parametrize("rows", [1, 2, 3, 8, 9, 17, 40])  # 40 x 1536: split on threads
def test_the_int16_product_agrees_with_the_rounded_reference(avx512, make, shape, rows):
    weight = make(*shape)
    packed = weight.kernel_pack(avx512)
    g = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, shape[1], generator=g) * torch.logspace(-3, 1, shape[1])).bfloat16()
    w = weight.dequantize()
    out = avx512.q4_i16_gemm(x, packed)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, shape[0])
    reference = split_reference(x) @ w.double().T
    assert product_error(out, reference, x, w).max() <= 1.0
    # and close to the exact product: each activation moves by at most 2^-14 of its group's
    # largest, far below bfloat16's own rounding of that value
    exact = x.double() @ w.double().T
    top = x.double().abs().reshape(rows, -1, 32).amax(-1, keepdim=True).expand(-1, -1, 32)
    moved = top.reshape(rows, -1) @ w.double().abs().T * 2.0 ** -14
    assert ((out.double() - exact).abs() <= reference.abs() * 2.0 ** -8 + moved + 1e-6 *
            (x.double().abs() @ w.double().abs().T)).all()
    assert not torch.equal(split_reference(x), x.double())  # (values spanning 12 binades)


def test_values_within_six_binades_of_the_groups_largest_are_exact(avx512):
    """Every bfloat16 value within 2^6 of its group's largest has at most 14 significant bits
    at the group's scale: the reference's rounding leaves them as they are; smaller ones
    round at 2^-14 of the largest."""
    g = torch.Generator().manual_seed(0)
    x = (torch.rand(4, 256, generator=g) * 63 + 1).bfloat16() * torch.where(
        torch.rand(4, 256, generator=g) < 0.5, -1.0, 1.0).bfloat16()
    assert torch.equal(split_reference(x), x.double())
    tiny = x.clone()
    tiny[:, 5] = 1e-4  # far below its group's largest value (>= 1)
    rounded = split_reference(tiny)
    assert not torch.equal(rounded, tiny.double())
    top = tiny.float().reshape(4, -1, 32).abs().amax(-1)[:, 0]
    assert ((rounded[:, 5] - 1e-4).abs() <= top.double() * 2.0 ** -14).all()
    weight = q4_k(32, 256)
    w = weight.dequantize()
    out = avx512.q4_i16_gemm(x, weight.kernel_pack(avx512))
    assert product_error(out, x.double() @ w.double().T, x, w).max() <= 1.0


def test_a_rows_result_does_not_depend_on_the_rows_beside_it(avx512):
    weight = q4_k(64, 512)
    packed = weight.kernel_pack(avx512)
    x = torch.randn(11, 512).bfloat16()
    together = avx512.q4_i16_gemm(x, packed)
    for r in (0, 7, 8, 10):
        assert torch.equal(avx512.q4_i16_gemm(x[r:r + 1], packed), together[r:r + 1])
    assert torch.equal(avx512.q4_i16_gemm(x[3:5], packed), together[3:5])


@pytest.mark.parametrize("power", [-100, -30, 30, 100])
def test_scaling_the_activations_by_a_power_of_two_scales_the_result_exactly(avx512, power):
    """The group's scale is a power of two, so the integers, and the sums, stay the same:
    no overflow at large values, no flush at small ones (within bfloat16's output range)."""
    weight = q4_1(32, 128)
    packed = weight.kernel_pack(avx512)
    x = torch.randn(2, 128).bfloat16()
    scaled = (x.double() * 2.0 ** power).bfloat16()
    assert torch.equal(scaled.double(), x.double() * 2.0 ** power)
    out = avx512.q4_i16_gemm(scaled, packed).double()
    assert torch.equal(out, avx512.q4_i16_gemm(x, packed).double() * 2.0 ** power)


def test_a_group_with_nan_or_inf_gives_nan_for_its_row_only(avx512):
    weight = q4_k(32, 512)
    packed = weight.kernel_pack(avx512)
    x = torch.randn(3, 512).bfloat16()
    clean = avx512.q4_i16_gemm(x, packed)
    x[0, 40] = float("nan")
    x[2, 300] = float("inf")
    out = avx512.q4_i16_gemm(x, packed)
    assert out[0].isnan().all() and out[2].isnan().all()
    assert torch.equal(out[1], clean[1])


def test_zero_rows_and_zero_activations(avx512):
    packed = q4_1(32, 64).kernel_pack(avx512)
    assert avx512.q4_i16_gemm(torch.empty(0, 64, dtype=torch.bfloat16), packed).shape == (0, 32)
    assert torch.equal(avx512.q4_i16_gemm(torch.zeros(2, 64, dtype=torch.bfloat16), packed),
                       torch.zeros(2, 32, dtype=torch.bfloat16))


def test_bad_inputs_are_refused(avx512):
    packed = q4_k(32, 256).kernel_pack(avx512)
    with pytest.raises(RuntimeError, match="256"):
        avx512.q4_i16_gemm(torch.randn(1, 128).bfloat16(), packed)
    with pytest.raises(RuntimeError, match="q4_pack"):
        avx512.q4_i16_gemm(torch.randn(1, 64).bfloat16(), torch.zeros(2, 2, 7, dtype=torch.uint8))


def test_without_an_int16_tile_the_exact_product_runs_instead(ops, isa):
    weight = q4_k(48, 512)
    packed = weight.kernel_pack(ops)
    x = torch.randn(3, 512).bfloat16()
    assert ops.int16_tiles_built() == (isa in cpu.INT16_LEVELS)
    if isa not in cpu.INT16_LEVELS:
        assert torch.equal(ops.q4_i16_gemm(x, packed), ops.q4_gemm(x, packed))


def test_q4_linear_takes_the_int16_product_up_to_its_rows(ops):
    packed = q4_k(32, 256).kernel_pack(ops)
    x = torch.randn(6, 256).bfloat16()
    for rows in range(1, 7):
        out = ops.q4_linear(x[:rows], packed, 5, ALL_ROWS, 2)
        if rows <= 2:
            expected = ops.q4_i16_gemm(x[:rows], packed)
        elif rows <= 5:
            expected = ops.q4_gemm(x[:rows], packed)
        else:
            expected = ops.q4_q8_gemm(x[:rows], packed)
        assert torch.equal(out, expected), rows
    assert torch.equal(ops.q4_linear(x[:2], packed, 5), ops.q4_gemm(x[:2], packed))  # default 0


def test_the_choice_follows_the_level_the_vendor_and_the_setting():
    assert cpu.int16_products("avx512", "GenuineIntel", None)
    assert not cpu.int16_products("avx512", "AuthenticAMD", None)
    assert cpu.int16_products("avx2", "GenuineIntel", None)
    assert cpu.int16_products("avx2", "AuthenticAMD", None)
    assert not cpu.int16_products("avx2", "AuthenticAMD", "0")
    assert not cpu.int16_products("avx512", "GenuineIntel", "0")
    assert cpu.int16_products("avx512", "AuthenticAMD", "1")
    assert not cpu.int16_products("portable", "GenuineIntel", "1")  # no tile there
    assert cpu.int16_products("avx512", "GenuineIntel", "yes")  # unrecognised: the default


def test_detect_reads_the_vendor_and_the_setting(monkeypatch):
    flags = frozenset(cpu.REQUIRED_FLAGS["avx512"])
    monkeypatch.setattr(cpu, "cpu_flags", lambda: flags)
    monkeypatch.setattr(cpu.platform, "machine", lambda: "x86_64")
    monkeypatch.delenv(cpu.INT16_ENV_VAR, raising=False)
    for vendor, expected in (("GenuineIntel", True), ("AuthenticAMD", False)):
        monkeypatch.setattr(cpu, "cpu_vendor", lambda v=vendor: v)
        found = cpu.detect("")
        assert (found.vendor, found.int16) == (vendor, expected)
    assert cpu.detect("avx2").int16  # every vendor at avx2
    assert not cpu.detect("portable").int16
    monkeypatch.setenv(cpu.INT16_ENV_VAR, "1")
    assert cpu.detect("").int16
    monkeypatch.setenv(cpu.INT16_ENV_VAR, "0")
    assert not cpu.detect("avx2").int16
    assert cpu.cpu_vendor() == "AuthenticAMD"  # (the stand-in)


def test_this_hosts_vendor_is_read_from_cpuinfo():
    vendor = cpu._cpuinfo_field(("vendor_id",))
    assert cpu.cpu_vendor() == (vendor or "")


def backend_with(int16: bool, amx: bool):
    backend = cpu_backend()
    if backend.kernels is None:
        pytest.skip("the C++ kernels are not built here")
    return dataclasses.replace(backend, cpu=dataclasses.replace(backend.cpu, int16=int16, amx=amx))


@pytest.mark.parametrize("int16, amx", [(False, False), (True, False), (True, True), (False, True)])
def test_layers_take_the_int16_rows_the_cpu_chooses(int16, amx):
    backend = backend_with(int16, amx)
    layer = QuantLinear(None, None, q4_k(64, 512), backend)
    assert layer.int16_max_rows == (INT16_MAX_ROWS[amx] if int16 else 0)
    if amx:
        assert layer.amx_exact_min_rows == max(AMX_EXACT_MIN_ROWS, layer.int16_max_rows + 1)
    ops = backend.kernels
    x = torch.randn(12, 512).bfloat16()
    assert layer.exact_max_rows == (ALL_ROWS if amx else q4_exact_max_rows(ops.isa(), backend.cpu.vendor))
    for rows in (1, 4, 5, 8):
        # int16 is an exact-range product: past exact_max_rows (1 row at avx2, none on Intel)
        # int8 rows win
        if rows <= min(layer.int16_max_rows, layer.exact_max_rows):
            assert torch.equal(layer(x[:rows]), ops.q4_i16_gemm(x[:rows], layer.packed)), rows
        elif not amx and rows <= layer.exact_max_rows:
            assert torch.equal(layer(x[:rows]), ops.q4_gemm(x[:rows], layer.packed)), rows
        elif not amx:
            assert torch.equal(layer(x[:rows]), ops.q4_q8_gemm(x[:rows], layer.packed)), rows


def test_verifying_proposals_takes_int16_as_the_requests_plain_step_would():
    from paged_helpers import LoopRowLimits

    limits = LoopRowLimits([ALL_ROWS], 5, 4)
    step = lambda requests, rows_each: limits.step(requests, rows_each)[1:]  # noqa: E731
    assert step(3, 1) == (5, 4)  # plain steps: the kernel decides by rows
    assert step(1, 5) == (ALL_ROWS, ALL_ROWS)  # one request verifying 4 proposals: int16
    assert step(4, 3) == (ALL_ROWS, ALL_ROWS)
    assert step(5, 3) == (0, 0)  # as many requests as the tiles take: on them
    assert limits.step(1, 5)[0] == [ALL_ROWS]  # exact throughout


def test_the_decode_loop_takes_the_layers_int16_rows(monkeypatch):
    """The default model built with int16 on and off: the C++ loop gets the layers' limit,
    and its logits stay bit-identical to the Python layers' either way."""
    from paged_helpers import run_paged
    from pagedllm import LLM

    if cpu_backend().kernels is None:
        pytest.skip("the C++ kernels are not built here")
    seqs = [[1, 504, 3300, 28, 253, 1135, 30, 216], [9690, 17, 2], list(range(100, 120))]
    results = {}
    for setting in ("0", "1"):
        monkeypatch.setenv(cpu.INT16_ENV_VAR, setting)
        model = LLM(dtype="bfloat16", kv_cache_memory=64 << 20).engine.runner.model
        loop = model.decode_loop
        cpu_now = capabilities()
        expected = INT16_MAX_ROWS[cpu_now.amx] if cpu_now.int16 else 0
        assert loop is not None and loop.int16_max_rows == expected
        fast = run_paged(model, seqs, block_size=16, chunk=1)
        with monkeypatch.context() as m:
            m.setattr(model, "decode_loop", None)
            slow = run_paged(model, seqs, block_size=16, chunk=1)
        assert all(torch.equal(f, s) for f, s in zip(fast, slow))
        results[setting] = fast
    for on, off in zip(results["1"], results["0"]):
        assert (on.argmax(-1) == off.argmax(-1)).float().mean() >= 0.9
