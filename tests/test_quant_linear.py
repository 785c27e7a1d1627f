"""The low-bit linear layers: 4-bit GGUF codes through pagedllm's q4_gemm kernel or torch's
int4 kernel, int8 output head. All must agree with the dense product of the weights they stand
for, at every row count, and the kernels at every CPU level the host runs (the `ops`
fixture)."""
import dataclasses

import pytest
import torch

from pagedllm.backends import cpu_backend
from pagedllm.kernels import cpu, torch_ops
from pagedllm.models.output_head import Q8Head, RefinedHead, output_head
from pagedllm.models.quant_linear import (ALL_ROWS, INT4_MAX_ROWS, INT8_MAX_ROWS, Q4_EXACT_MAX_ROWS,
                                          DenseLinear, Int8Linear, QuantLinear, q4_exact_max_rows)
from pagedllm.weights.q4 import GROUP_SIZE, Q4Weight
from pagedllm.weights.q8 import Q8Rows


def random_q4(out: int, cols: int, seed: int = 0) -> Q4Weight:
    """Random codes with float16-exact d and m, as decode_q4 gives them for Q4_1."""
    gen = torch.Generator().manual_seed(seed)
    d = (torch.rand(out, cols // GROUP_SIZE, generator=gen) * 0.02).half().float()
    m = (torch.randn(out, cols // GROUP_SIZE, generator=gen) * 0.05).half().float()
    codes = torch.randint(0, 16, (out, cols), dtype=torch.uint8, generator=gen)
    return Q4Weight(codes, d, m)


def relative_error(approx: torch.Tensor, exact: torch.Tensor) -> float:
    return ((approx.float() - exact).norm() / exact.norm()).item()


@pytest.mark.parametrize("rows", [1, 2, 7, 8, 9, 16, 17, 33, 128])
@pytest.mark.parametrize("out,cols", [(96, 128), (16, 32), (960, 576)])
def test_q4_gemm_is_exact_up_to_the_output_rounding(ops, rows, out, cols):
    """Codes and bf16 activations are multiplied without rounding; only the bf16 result is."""
    q4 = random_q4(out, cols, seed=rows)
    weight = q4.dequantize()
    x = torch.randn(rows, cols).bfloat16()
    exact = x.float() @ weight.T
    got = ops.q4_gemm(x, ops.q4_pack(q4.codes, q4.d, q4.m))
    assert got.dtype == torch.bfloat16 and got.shape == (rows, out)
    assert ((got.float() - exact).abs() <= exact.abs() * 2 ** -8 + 1e-4).all()


def test_q4_gemm_reads_strided_input_and_empty_batches(ops):
    q4 = random_q4(32, 64)
    packed = ops.q4_pack(q4.codes, q4.d, q4.m)
    wide = torch.randn(5, 128).bfloat16()
    assert torch.equal(ops.q4_gemm(wide[:, ::2], packed), ops.q4_gemm(wide[:, ::2].contiguous(), packed))
    assert ops.q4_gemm(torch.empty(0, 64, dtype=torch.bfloat16), packed).shape == (0, 32)


def test_q4_gemm_rejects_bad_input(ops):
    q4 = random_q4(32, 64)
    d, m = q4.d, q4.m
    packed = ops.q4_pack(q4.codes, d, m)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        ops.q4_pack(q4.codes[:24], d[:24], m[:24])
    with pytest.raises(RuntimeError, match="multiple of 32"):
        ops.q4_pack(q4.codes[:, :48], d, m)
    with pytest.raises(RuntimeError, match="0..15"):
        ops.q4_pack(q4.codes | 0x10, d, m)
    with pytest.raises(RuntimeError, match="uint8"):
        ops.q4_pack(q4.codes.int(), d, m)
    with pytest.raises(RuntimeError, match=r"\[N, K / 32\]"):
        ops.q4_pack(q4.codes, d[:, :1], m)
    with pytest.raises(RuntimeError, match="x has 32 inputs, the weight 64"):
        ops.q4_gemm(torch.randn(2, 32).bfloat16(), packed)
    with pytest.raises(RuntimeError, match="bfloat16"):
        ops.q4_gemm(torch.randn(2, 64), packed)
    with pytest.raises(RuntimeError, match="q4_pack"):
        ops.q4_gemm(torch.randn(2, 64).bfloat16(), q4.codes)


def int8_rounded(x: torch.Tensor, group: int = GROUP_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """x rounded to int8 per group of 32 inputs, or as many as share a scale (scale max|x| /
    127), as float32, and where a code may round either way: an element at half a step
    (x = max|x| / 2 is common in bfloat16) lands on 63.5 give or take the last bit of
    127 / max|x|, the kernel's or torch's."""
    groups = x.float().view(x.shape[0], -1, group)
    amax = groups.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    scaled = groups * inv
    either_way = ((scaled - scaled.floor() - 0.5).abs() < 1e-4) * (amax / 127)
    return (torch.round(scaled) * (amax / 127)).view(x.shape), either_way.view(x.shape)


@pytest.mark.parametrize("rows", [1, 7, 8, 9, 33, 300])
@pytest.mark.parametrize("out,cols", [(16, 32), (96, 128), (960, 576)])
def test_q4_q8_gemm_is_the_exact_product_of_int8_rounded_activations(ops, rows, out, cols):
    """The integer dot products are exact: the only differences from the dequantized weights
    times the int8-rounded activations are float32 sums and the bf16 result."""
    q4 = random_q4(out, cols, seed=rows)
    weight = q4.dequantize()
    x = torch.randn(rows, cols).bfloat16()
    if cols > GROUP_SIZE:
        x[0, :GROUP_SIZE] = 0  # an all-zero group: scale 0, no division by it
    got = ops.q4_q8_gemm(x, ops.q4_pack(q4.codes, q4.d, q4.m))
    assert got.dtype == torch.bfloat16 and got.shape == (rows, out)
    rounded, either_way = int8_rounded(x)
    expected = rounded @ weight.T
    tie_slack = either_way @ weight.abs().T
    assert ((got.float() - expected).abs() <= expected.abs() * 2 ** -8 + 1e-4 + tie_slack).all()
    exact = x.float() @ weight.T
    assert relative_error(got, exact) < 0.02  # what the rounding costs


def test_q4_q8_gemm_strided_empty_and_non_finite_input(ops):
    q4 = random_q4(32, 64)
    packed = ops.q4_pack(q4.codes, q4.d, q4.m)
    wide = torch.randn(12, 128).bfloat16()
    assert torch.equal(ops.q4_q8_gemm(wide[:, ::2], packed), ops.q4_q8_gemm(wide[:, ::2].contiguous(), packed))
    assert ops.q4_q8_gemm(torch.empty(0, 64, dtype=torch.bfloat16), packed).shape == (0, 32)
    x = torch.randn(12, 64).bfloat16()
    x[3, 40] = float("nan")
    x[7, 2] = float("inf")
    out = ops.q4_q8_gemm(x, packed)
    assert out[3].isnan().all() and out[7].isnan().all()  # not an undefined integer cast
    ok = [r for r in range(12) if r not in (3, 7)]
    assert torch.equal(out[ok], ops.q4_q8_gemm(x[ok], packed))  # rows stay independent
    with pytest.raises(RuntimeError, match="x has 32 inputs, the weight 64"):
        ops.q4_q8_gemm(torch.randn(2, 32).bfloat16(), packed)
    with pytest.raises(RuntimeError, match="bfloat16"):
        ops.q4_q8_gemm(torch.randn(2, 64), packed)
    with pytest.raises(RuntimeError, match="q4_pack"):
        ops.q4_q8_gemm(torch.randn(2, 64).bfloat16(), q4.codes)


def test_q4_linear_switches_to_int8_activations_above_the_exact_rows(ops):
    q4 = random_q4(96, 128)
    packed = ops.q4_pack(q4.codes, q4.d, q4.m)
    for rows in (4, 5):
        x = torch.randn(rows, 128).bfloat16()
        assert torch.equal(ops.q4_linear(x, packed, 4),
                           ops.q4_gemm(x, packed) if rows <= 4 else ops.q4_q8_gemm(x, packed))


def _without_kernels():
    """The CPU backend as it is without the C++ kernels (no compiler)."""
    return dataclasses.replace(cpu_backend(), kernels=None)


def _torch_int4_only():
    if not torch_ops().int4_matmul:
        pytest.skip("torch without the CPU int4 kernel")
    return _without_kernels()


# kernel -> (exact_max_rows, max_rows, keeps a dense copy)
LAYER_KERNELS = {"q4_q8_gemm": (None, ALL_ROWS, False),  # exact rows: the level's (and vendor's)
                 "q4_gemm exact only": (ALL_ROWS, ALL_ROWS, False),
                 "torch_int4": (INT4_MAX_ROWS, INT4_MAX_ROWS, True)}


@pytest.mark.parametrize("kernel", list(LAYER_KERNELS))
@pytest.mark.parametrize("rows", [1, INT4_MAX_ROWS + 1, 129, 300])
def test_int4_layer_matches_dequantized_weights(at_isa, kernel, rows):
    backend = _torch_int4_only() if kernel == "torch_int4" else cpu_backend()
    # (the level's own kernels: on an AMX host every step below 128 rows is exact on the
    # tiles instead, test_amx.py)
    backend = dataclasses.replace(backend, cpu=dataclasses.replace(backend.cpu, amx=False))
    torch.manual_seed(0)
    q4 = random_q4(96, 128)
    weight = q4.dequantize()
    bias = torch.randn(96).bfloat16()
    layer = QuantLinear(weight.bfloat16(), bias, q4, backend,
                        int8_activations=kernel != "q4_gemm exact only")
    exact_max_rows, max_rows, dense = LAYER_KERNELS[kernel]
    exact_max_rows = exact_max_rows or q4_exact_max_rows(at_isa, backend.cpu.vendor)
    assert (layer.exact_max_rows, layer.max_rows, layer.dense is not None) == (exact_max_rows, max_rows, dense)
    if layer.q4_ops is not None:
        assert layer.q4_ops.isa() == at_isa
    x = torch.randn(rows, 128)
    exact = x @ weight.T + bias.float()
    assert relative_error(layer(x.bfloat16()), exact) < 0.02  # bf16 (or int8) activations


def test_one_row_stays_exact_but_on_intel_cores_at_avx2():
    """Layers that round activations to int8 keep one row exact (a single sequence's decode),
    but on an Intel core at avx2, whose exact one-row product is bound by the core."""
    assert q4_exact_max_rows("avx2", "GenuineIntel") == 0
    assert q4_exact_max_rows("avx2", "AuthenticAMD") == Q4_EXACT_MAX_ROWS["avx2"] == 1
    assert q4_exact_max_rows("avx2", "") == 1  # a vendor not reported: the level's
    assert q4_exact_max_rows("avx512", "GenuineIntel") == Q4_EXACT_MAX_ROWS["avx512"]
    assert q4_exact_max_rows("portable", "GenuineIntel") == Q4_EXACT_MAX_ROWS["portable"]
    with pytest.raises(KeyError):
        q4_exact_max_rows("avx10", "GenuineIntel")


@pytest.mark.parametrize("vendor", ["GenuineIntel", "AuthenticAMD"])
def test_a_layer_multiplies_one_row_as_its_vendor_and_level_choose(at_isa, vendor):
    """One row through a 4-bit layer that rounds activations: bit for bit the int8 product
    where q4_exact_max_rows says 0, else the level's exact one (int16 where the CPU takes it)."""
    backend = cpu_backend()
    if backend.kernels is None:
        pytest.skip("the C++ kernels are not built here")
    int16 = cpu.int16_products(at_isa, vendor, None)
    backend = dataclasses.replace(backend, cpu=dataclasses.replace(
        backend.cpu, amx=False, vendor=vendor, int16=int16))
    torch.manual_seed(0)
    layer = QuantLinear(None, None, random_q4(64, 256), backend)
    ops = layer.q4_ops
    assert ops.isa() == at_isa
    assert layer.exact_max_rows == q4_exact_max_rows(at_isa, vendor)
    x = torch.randn(2, 256).bfloat16()
    exact = ops.q4_i16_gemm if int16 else ops.q4_gemm
    for rows in (1, 2):
        kernel = exact if rows <= layer.exact_max_rows else ops.q4_q8_gemm
        assert torch.equal(layer(x[:rows]), kernel(x[:rows], layer.packed)), rows
    if at_isa == "avx2" and vendor == "GenuineIntel":
        # int8 from one row: a sequence's row is the same alone as beside another
        assert layer.exact_max_rows == 0
        assert torch.equal(layer(x[:1])[0], layer(x)[0])


def test_int4_layer_runs_dense_for_outputs_the_kernels_cannot_tile():
    """Both 4-bit kernels take output rows by 16; other shapes use the dense copy."""
    q4 = random_q4(40, 64)
    layer = QuantLinear(q4.dequantize().bfloat16(), None, q4, cpu_backend())
    assert layer.q4_ops is None and layer.max_rows == 0 and layer.dense is not None
    x = torch.randn(3, 64).bfloat16()
    assert relative_error(layer(x), x.float() @ q4.dequantize().T) < 0.02


def test_q4_weight_gives_torch_kernel_form_of_the_same_weights():
    q4 = random_q4(32, 64)
    scales, zeros = q4.torch_scales_zeros()
    groups = (q4.codes.float() - 8).view(32, 2, 32)
    torch_form = (groups * scales.unsqueeze(-1) + zeros.unsqueeze(-1)).view(32, 64)
    assert torch.allclose(torch_form, q4.dequantize(), atol=1e-6)


@pytest.mark.skipif(not torch_ops().int8_matmul, reason="torch without the CPU int8 kernel")
@pytest.mark.parametrize("rows", [1, INT8_MAX_ROWS, INT8_MAX_ROWS + 1])
def test_int8_head_matches_float_weights(rows):
    torch.manual_seed(1)
    weight = torch.randn(1000, 64)
    weight[3] *= 50  # one large row: scales are per row, so the others keep their precision
    layer = Int8Linear(weight, cpu_backend())
    assert layer.codes.dtype == torch.int8 and layer.codes.abs().max() <= 127
    x = torch.randn(rows, 64)
    exact = x @ weight.T
    approx = layer(x.bfloat16()).float()
    assert relative_error(approx[:, :3], exact[:, :3]) < 0.02
    assert relative_error(approx, exact) < 0.02


def test_int8_head_survives_an_all_zero_row():
    weight = torch.randn(16, 32)
    weight[5] = 0
    out = Int8Linear(weight, cpu_backend())(torch.randn(2, 32).bfloat16())
    assert out.isfinite().all() and (out[:, 5] == 0).all()


@pytest.mark.parametrize("rows", [1, 17, 300])
def test_dense_linear_matches_f_linear_at_every_level(at_isa, rows):
    """Prepacked for oneDNN (bit-identical to F.linear) only where the level has bfloat16
    arithmetic; below it oneDNN's bf16 path refuses the CPU, so the product runs in float32."""
    torch.manual_seed(2)
    weight, bias = torch.randn(96, 64).bfloat16(), torch.randn(96).bfloat16()
    x = torch.randn(rows, 64).bfloat16()
    layer = DenseLinear(weight, bias, cpu_backend())
    native = at_isa == "avx512"
    assert layer.prepacked == (native and torch.backends.mkldnn.is_available())
    assert layer.widened == (not layer.prepacked)
    if layer.prepacked:
        assert torch.equal(layer(x), torch.nn.functional.linear(x, weight, bias))
        assert torch.equal(DenseLinear(weight, None, cpu_backend())(x), torch.nn.functional.linear(x, weight))
    else:
        assert layer.weight.dtype == torch.float32
        wide = torch.nn.functional.linear(x.float(), weight.float(), bias.float()).bfloat16()
        assert layer(x).dtype == torch.bfloat16 and torch.equal(layer(x), wide)
    assert not DenseLinear(weight.float(), None, cpu_backend()).prepacked  # float32 stays plain
    assert not DenseLinear(weight.float(), None, cpu_backend()).widened


def test_prepacked_dense_linear_lets_the_original_weight_go():
    """nn.Linear weights require grad; packing them must not keep them alive (it once did,
    through autograd, and cost 212 MB of resident memory on the default model)."""
    import gc
    import weakref

    from pagedllm.models.quant_linear import DenseLinear

    weight = torch.nn.Parameter(torch.randn(64, 32).bfloat16())
    original = weakref.ref(weight)
    layer = DenseLinear(weight, None, cpu_backend())
    del weight
    gc.collect()
    assert original() is None
    assert layer(torch.randn(2, 32).bfloat16()).shape == (2, 64)


def random_q8(out: int, cols: int, seed: int = 0) -> Q8Rows:
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(-128, 128, (out, cols), dtype=torch.int8, generator=gen)
    return Q8Rows(codes, (torch.rand(out, cols // GROUP_SIZE, generator=gen) * 0.01).half().float())


def q8_dense(q8: Q8Rows) -> torch.Tensor:
    return q8.rows(torch.arange(q8.codes.shape[0]))


@pytest.mark.parametrize("rows", [1, 3, 8, 9, 17, 64])
def test_q8_gemm_is_exact_when_activations_fit_int8(ops, rows):
    """Activations are rounded to int8 per group of 32 (scale max|x| / 127); rows that are
    already integers with a group maximum of 127 round to themselves, and then the int32
    sums and one float32 scale multiply per group leave only float32 summation error."""
    q8 = random_q8(48, 96, seed=rows)
    x = torch.randint(-127, 128, (rows, 96)).float()
    x.view(rows, 3, 32)[:, :, 0] = 127
    exact = x.double() @ q8_dense(q8).double().T
    got = ops.q8_gemm(x.bfloat16(), ops.q8_pack(q8.codes, q8.scales))
    assert got.dtype == torch.float32 and got.shape == (rows, 48)
    assert torch.allclose(got.double(), exact, rtol=1e-5, atol=1e-3)


@pytest.mark.parametrize("rows", [1, 8, 16])
def test_q8_gemm_stays_within_activation_rounding(ops, rows):
    q8 = random_q8(49152 // 64, 576)
    x = torch.randn(rows, 576).bfloat16()
    exact = x.float() @ q8_dense(q8).T
    got = ops.q8_gemm(x, ops.q8_pack(q8.codes, q8.scales))
    assert relative_error(got, exact) < 0.01
    zero = ops.q8_gemm(torch.zeros(2, 576).bfloat16(), ops.q8_pack(q8.codes, q8.scales))
    assert (zero == 0).all()  # an all-zero group has scale 0, not NaN
    bad = x[:1].clone()
    bad[0, 5] = float("nan")
    assert ops.q8_gemm(bad, ops.q8_pack(q8.codes, q8.scales)).isnan().all()  # NaN in, NaN out


def test_q8_gemm_rejects_bad_input(ops):
    q8 = random_q8(32, 64)
    packed = ops.q8_pack(q8.codes, q8.scales)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        ops.q8_pack(q8.codes[:24], q8.scales[:24])
    with pytest.raises(RuntimeError, match="multiple of 32"):
        ops.q8_pack(q8.codes[:, :48], q8.scales)
    with pytest.raises(RuntimeError, match="int8"):
        ops.q8_pack(q8.codes.to(torch.uint8), q8.scales)
    with pytest.raises(RuntimeError, match=r"d must be \[N, K / 32\]"):
        ops.q8_pack(q8.codes, q8.scales[:, :1])
    with pytest.raises(RuntimeError, match="x has 32 inputs, the weight 64"):
        ops.q8_gemm(torch.randn(2, 32).bfloat16(), packed)
    with pytest.raises(RuntimeError, match="bfloat16"):
        ops.q8_gemm(torch.randn(2, 64), packed)
    with pytest.raises(RuntimeError, match="q8_pack"):
        ops.q8_gemm(torch.randn(2, 64).bfloat16(), ops.q4_pack(torch.zeros(32, 64, dtype=torch.uint8),
                                                                  torch.ones(32, 2), torch.ones(32, 2)))


def test_output_head_prefers_the_q8_codes(at_isa, monkeypatch):
    """Both head shapes give the approximate logits with the top 16 exact, whatever built."""
    torch.manual_seed(0)
    q8 = random_q8(4096, 64)
    weight = q8_dense(q8)
    x = torch.randn(5, 64).bfloat16()
    exact = x.float() @ weight.T

    def check(head, kind):
        """Approximate logits, of which each row's 16 candidates are exact (the 16 the
        approximation ranked highest, so not always the exact top 16), the best among them."""
        assert isinstance(head, kind)
        logits = head(x)
        assert logits.dtype == torch.float32 and relative_error(logits, exact) < 0.01
        refined = torch.isclose(logits, exact, rtol=1e-5, atol=1e-5)
        assert (refined.sum(-1) >= 16).all()
        assert torch.equal(logits.argmax(-1), exact.argmax(-1))

    head = output_head(weight, q8, 16, cpu_backend())
    check(head, Q8Head)  # every kernel level has q8_gemm
    assert head.ops.isa() == at_isa
    # No kernel, or a shape it cannot tile: a refined int8 (or dense) head from the weight.
    check(output_head(weight, None, 16, cpu_backend()), RefinedHead)
    cut = output_head(weight[:40], Q8Rows(q8.codes[:40], q8.scales[:40]), 16, cpu_backend())
    assert isinstance(cut, RefinedHead)
    check(output_head(weight, q8, 16, _without_kernels()), RefinedHead)


@pytest.mark.parametrize("rows", [1, 5])
def test_q8_refine_top_recomputes_the_best_logits_exactly(ops, rows):
    q8 = random_q8(4096, 64, seed=rows)
    hidden = torch.randn(rows, 64).bfloat16()
    logits = ops.q8_gemm(hidden, ops.q8_pack(q8.codes, q8.scales))
    exact = hidden.float() @ q8_dense(q8).T
    refined = ops.q8_refine_top(logits.clone(), hidden, q8.codes, q8.scales, 16)
    top = logits.topk(16, dim=-1).indices
    assert torch.allclose(refined.gather(1, top), exact.gather(1, top), rtol=1e-5, atol=1e-5)
    rest = torch.ones_like(logits, dtype=torch.bool).scatter_(1, top, False)
    assert torch.equal(refined[rest], logits[rest])  # everything else untouched
    assert torch.equal(refined.argmax(-1), exact.argmax(-1))


def test_q8_refine_top_rejects_bad_input(ops):
    q8 = random_q8(32, 64)
    hidden, logits = torch.randn(2, 64).bfloat16(), torch.randn(2, 32)
    with pytest.raises(RuntimeError, match="top must be in 1..N"):
        ops.q8_refine_top(logits, hidden, q8.codes, q8.scales, 33)
    with pytest.raises(RuntimeError, match="float32"):
        ops.q8_refine_top(logits.double(), hidden, q8.codes, q8.scales, 4)
    with pytest.raises(RuntimeError, match=r"codes must be \[N, K\] for logits"):
        ops.q8_refine_top(torch.randn(2, 48), hidden, torch.zeros(48, 32, dtype=torch.int8),
                          q8.scales[:48, :1], 4)
    with pytest.raises(RuntimeError, match="hidden must be"):
        ops.q8_refine_top(logits, hidden[:1], q8.codes, q8.scales, 4)
