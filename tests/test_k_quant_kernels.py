"""Q4_K and Q6_K multiplied in their own layouts (q4k_pack / q6_pack), at every CPU level the
host runs (the `ops` fixture): the products equal the dequantized weights' within what the
kernels round (the bfloat16 result; int8 activations where the kernel rounds them), and bad
input is refused with what is wrong."""
import pytest
import torch

from pagedllm.backends import cpu_backend
from pagedllm.kernels import kernel_ops
from pagedllm.models.quant_linear import Q6Linear, QuantLinear
from pagedllm.weights.q4 import Q4KWeight, Q4Weight, cat_4bit
from pagedllm.weights.q6 import Q6Weight
from test_quant_linear import int8_rounded, random_q4, relative_error


def random_q4k(out: int, cols: int, seed: int = 0) -> Q4KWeight:
    gen = torch.Generator().manual_seed(seed)
    return Q4KWeight(torch.randint(0, 16, (out, cols), dtype=torch.uint8, generator=gen),
                     torch.randint(0, 64, (out, cols // 32), dtype=torch.uint8, generator=gen),
                     torch.randint(0, 64, (out, cols // 32), dtype=torch.uint8, generator=gen),
                     (torch.rand(out, cols // 256, generator=gen) * 1e-3).half().float(),
                     (torch.rand(out, cols // 256, generator=gen) * 1e-3).half().float())


def random_q6(out: int, cols: int, seed: int = 0) -> Q6Weight:
    gen = torch.Generator().manual_seed(seed)
    return Q6Weight(torch.randint(0, 64, (out, cols), dtype=torch.uint8, generator=gen),
                    torch.randint(-128, 128, (out, cols // 16), dtype=torch.int8, generator=gen),
                    (torch.rand(out, cols // 256, generator=gen) * 1e-3).half().float())


SHAPES = [(16, 256), (48, 512), (96, 768)]
ROWS = [1, 7, 9, 33]  # a row block of 1, of 7, of 8 then 1, of 8 four times then 1
# q4_q8_gemm rounds a Q4_K product's activations with one scale per 256 inputs (llama.cpp's
# Q8_K), so that the avx2 tile folds the 6-bit scales in integers. (q6_gemm keeps one per 32:
# its avx2 tile already folds its scales, and a scale per 256 measured no faster there.)
Q4K_INPUTS_PER_SCALE = 256


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("out,cols", SHAPES)
def test_q4k_exact_kernel_equals_the_dequantized_product(ops, rows, out, cols):
    """q4_gemm on Q4_K's two-level scales is exact up to the bfloat16 result: d * sc and
    dmin * mn are formed in float32 inside the kernel, never rounded to float16."""
    q4k = random_q4k(out, cols, seed=rows)
    weight = q4k.dequantize()
    x = torch.randn(rows, cols).bfloat16()
    exact = x.float() @ weight.T
    packed = q4k.kernel_pack(ops)
    assert packed.shape == (out // 16, cols // 256, 2368)
    got = ops.q4_gemm(x, packed)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, out)
    assert ((got.float() - exact).abs() <= exact.abs() * 2 ** -8 + 1e-4).all()


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("out,cols", SHAPES)
def test_q4k_int8_kernel_is_the_product_of_int8_rounded_activations(ops, rows, out, cols):
    q4k = random_q4k(out, cols, seed=rows)
    weight = q4k.dequantize()
    x = torch.randn(rows, cols).bfloat16()
    if cols > 256:
        x[0, :256] = 0  # an all-zero block (not the whole row): scale 0, no division by it
    got = ops.q4_q8_gemm(x, q4k.kernel_pack(ops))
    rounded, either_way = int8_rounded(x, Q4K_INPUTS_PER_SCALE)
    expected = rounded @ weight.T
    slack = either_way @ weight.abs().T
    assert ((got.float() - expected).abs() <= expected.abs() * 2 ** -8 + 1e-4 + slack).all()
    assert relative_error(got, x.float() @ weight.T) < 0.02


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_q4k_int8_kernel_at_the_edges_of_its_integer_ranges(ops, sign):
    """Every code 15, every scale and min 63, every activation code +-127: each group's int16
    sums reach 30480 and a block's scaled int32 sums their largest, and the mins meet the
    largest code sums; the product is still exact (the avx2 tile folds them in integers)."""
    out, cols, rows = 16, 768, 9
    q4k = Q4KWeight(torch.full((out, cols), 15, dtype=torch.uint8),
                    torch.full((out, cols // 32), 63, dtype=torch.uint8),
                    torch.full((out, cols // 32), 63, dtype=torch.uint8),
                    torch.full((out, cols // 256), 2.0 ** -10), torch.full((out, cols // 256), 2.0 ** -12))
    x = torch.full((rows, cols), sign).bfloat16()
    x[1::2, 256:512] = -sign  # blocks of opposite sign: code sums of both signs in the pairs
    got = ops.q4_q8_gemm(x, q4k.kernel_pack(ops))
    expected = x.double() @ q4k.dequantize().double().T  # +-1 rounds to +-127 codes exactly
    assert torch.equal(got, expected.bfloat16())


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("out,cols", SHAPES)
def test_q6_kernel_is_the_product_of_int8_rounded_activations(ops, rows, out, cols):
    """Every 6-bit code (low nibble and high 2 bits from their own planes), every int8 scale
    per 16 inputs (both signs) and d per 256 land where they belong: the result is the
    dequantized weight times the int8-rounded activations, up to float32 sums."""
    q6 = random_q6(out, cols, seed=rows)
    weight = q6.dequantize()
    x = torch.randn(rows, cols).bfloat16()
    x[0, 32:64] = 0
    packed = ops.q6_pack(q6.codes, q6.scales, q6.d)
    assert packed.shape == (out // 16, cols // 256, 3360)
    got = ops.q6_gemm(x, packed)
    assert got.dtype == torch.float32 and got.shape == (rows, out)
    rounded, either_way = int8_rounded(x)
    expected = rounded.double() @ weight.double().T
    slack = either_way @ weight.abs().T
    assert ((got.double() - expected).abs() <= expected.abs() * 1e-5 + 1e-5 + slack).all()
    assert relative_error(got, x.float() @ weight.T) < 0.02


@pytest.mark.parametrize("rows", [2, 5, 8, 11, 19])
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(ops, rows):
    """The int8 products take rows in passes of a few (and 8 per block): every row, taken
    alone or with neighbours that fall in another pass, gets the same bits (a sequence's
    tokens do not depend on who else is in the step)."""
    g = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 512, generator=g) * torch.logspace(-2, 1, 512)).bfloat16()
    q6, q4k, q4 = random_q6(48, 512, seed=rows), random_q4k(48, 512, seed=rows), random_q4(48, 512)
    cases = [(ops.q6_gemm, ops.q6_pack(q6.codes, q6.scales, q6.d)),
             (ops.q4_q8_gemm, q4k.kernel_pack(ops)), (ops.q4_q8_gemm, q4.kernel_pack(ops))]
    if ops.int16_tiles_built():
        cases += [(ops.q4_i16_gemm, q4k.kernel_pack(ops)), (ops.q4_i16_gemm, q4.kernel_pack(ops))]
    for gemm, packed in cases:
        together = gemm(x, packed)
        for r in range(rows):
            assert torch.equal(gemm(x[r:r + 1], packed), together[r:r + 1]), (gemm, r)
        assert torch.equal(gemm(x[1:rows - 1], packed), together[1:rows - 1]), gemm


def test_q6_kernel_takes_a_prefills_rows_whole_with_the_same_bits(ops):
    """From 48 rows (q6_gemm.cpp's kUnpackedMinRows) the avx2 tile takes each tile with all
    the rows, unpacking each block once: the product is still the int8-rounded one, every row
    gets the bits it gets alone (where the per-pass tile runs), and a NaN stays in its row.
    70 rows: passes of 4 and a last one of 2."""
    rows, out, cols = 70, 48, 768
    q6 = random_q6(out, cols, seed=3)
    weight = q6.dequantize()
    g = torch.Generator().manual_seed(70)
    x = (torch.randn(rows, cols, generator=g) * torch.logspace(-2, 1, cols)).bfloat16()
    x[5, 300] = float("nan")
    packed = ops.q6_pack(q6.codes, q6.scales, q6.d)
    got = ops.q6_gemm(x, packed)
    assert got[5].isnan().all() and not got[torch.arange(rows) != 5].isnan().any()
    for r in (0, 3, 4, 47, 48, 68, 69):
        assert torch.equal(ops.q6_gemm(x[r:r + 1], packed), got[r:r + 1]), r
    assert ops.q6_gemm(x[5:6], packed).isnan().all()
    assert torch.equal(ops.q6_gemm(x[10:60], packed), got[10:60])  # 50 rows, from row 10
    clean = torch.arange(rows) != 5
    rounded, either_way = int8_rounded(x[clean])
    expected = rounded.double() @ weight.double().T
    slack = either_way @ weight.abs().T
    assert ((got[clean].double() - expected).abs() <= expected.abs() * 1e-5 + 1e-5 + slack).all()


def test_q6_kernel_codes_at_their_extremes(ops):
    """Codes 0 and 63 (high bits 00 and 11 in every position) with scales -128 and 127."""
    codes = torch.zeros(32, 512, dtype=torch.uint8)
    codes[:, 1::2] = 63
    codes[1::3] = 63 - codes[1::3]
    scales = torch.full((32, 32), 127, dtype=torch.int8)
    scales[:, ::3] = -128
    q6 = Q6Weight(codes, scales, torch.full((32, 2), 2.0 ** -10))
    x = torch.randint(-127, 128, (50, 512)).float()  # 50 rows: the whole-tile path too
    x.view(50, 16, 32)[:, :, 0] = 127  # integer activations round to themselves
    got = ops.q6_gemm(x.bfloat16(), ops.q6_pack(codes, scales, q6.d))
    assert torch.allclose(got.double(), x.double() @ q6.dequantize().double().T, rtol=1e-6, atol=1e-6)


def test_k_quant_kernels_take_strided_empty_and_non_finite_input(ops):
    q6, q4k = random_q6(32, 256), random_q4k(32, 256)
    packed6, packed4 = ops.q6_pack(q6.codes, q6.scales, q6.d), q4k.kernel_pack(ops)
    wide = torch.randn(5, 512).bfloat16()
    for gemm, packed in ((ops.q6_gemm, packed6), (ops.q4_gemm, packed4), (ops.q4_q8_gemm, packed4)):
        assert torch.equal(gemm(wide[:, ::2], packed), gemm(wide[:, ::2].contiguous(), packed))
        assert gemm(torch.empty(0, 256, dtype=torch.bfloat16), packed).shape == (0, 32)
    x = torch.randn(4, 256).bfloat16()
    x[2, 100] = float("nan")
    out = ops.q6_gemm(x, packed6)
    assert out[2].isnan().all() and not out[[0, 1, 3]].isnan().any()
    # Q4_K's int8 product rounds a block of 256 with one scale: a NaN or an infinity anywhere
    # in it gives that row NaN (not an undefined integer cast), through the folded sums too.
    x[1, 7] = float("inf")
    out = ops.q4_q8_gemm(x, packed4)
    assert out[[1, 2]].isnan().all() and not out[[0, 3]].isnan().any()


def test_k_quant_kernels_reject_bad_input(ops):
    q6, q4k = random_q6(32, 512), random_q4k(32, 512)
    with pytest.raises(RuntimeError, match="multiple of 256"):
        ops.q6_pack(q6.codes[:, :480], q6.scales[:, :30], q6.d)
    with pytest.raises(RuntimeError, match="multiple of 256"):
        ops.q4k_pack(q4k.codes[:, :480], q4k.scales[:, :15], q4k.mins[:, :15], q4k.d, q4k.dmin)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        ops.q6_pack(q6.codes[:24], q6.scales[:24], q6.d[:24])
    with pytest.raises(RuntimeError, match="0..63"):
        ops.q6_pack(q6.codes | 0x40, q6.scales, q6.d)
    with pytest.raises(RuntimeError, match="0..63"):
        ops.q4k_pack(q4k.codes, q4k.scales | 0x40, q4k.mins, q4k.d, q4k.dmin)
    with pytest.raises(RuntimeError, match="0..15"):
        ops.q4k_pack(q4k.codes | 0x10, q4k.scales, q4k.mins, q4k.d, q4k.dmin)
    with pytest.raises(RuntimeError, match=r"scales must be \[N, K / 16\] int8"):
        ops.q6_pack(q6.codes, q6.scales.to(torch.uint8), q6.d)
    with pytest.raises(RuntimeError, match=r"d must be \[N, K / 256\]"):
        ops.q6_pack(q6.codes, q6.scales, q6.d[:, :1])
    with pytest.raises(RuntimeError, match=r"d and dmin must be \[N, K / 256\]"):
        ops.q4k_pack(q4k.codes, q4k.scales, q4k.mins, q4k.d[:, :1], q4k.dmin)
    packed6 = ops.q6_pack(q6.codes, q6.scales, q6.d)
    with pytest.raises(RuntimeError, match="x has 256 inputs, the weight 512"):
        ops.q6_gemm(torch.randn(2, 256).bfloat16(), packed6)
    with pytest.raises(RuntimeError, match="q6_pack"):  # another kernel's tiles
        ops.q6_gemm(torch.randn(2, 512).bfloat16(), q4k.kernel_pack(ops))
    with pytest.raises(RuntimeError, match="q4_pack"):
        ops.q4_gemm(torch.randn(2, 512).bfloat16(), packed6)


def test_layers_pack_each_format_in_its_own_layout(at_isa):
    """QuantLinear packs Q4_K two-level, Q4_0/Q4_1 per group; a fused projection of Q4_K
    parts stays Q4_K, one mixing formats goes per group; Q6Linear equals its weights."""
    q4k, q4 = random_q4k(32, 256, seed=1), random_q4(32, 256, seed=2)
    # Seeded: 3 rows take int8-rounded activations at some levels, whose error on unseeded
    # draws came within reach of the bound now and then.
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(4)).bfloat16()
    assert QuantLinear(None, None, q4k, cpu_backend()).packed.shape[-1] == 2368
    assert QuantLinear(None, None, q4, cpu_backend()).packed.shape[-1] == 320
    assert isinstance(cat_4bit([q4k, q4k]), Q4KWeight)
    mixed = cat_4bit([q4k, q4])
    assert isinstance(mixed, Q4Weight)
    assert torch.equal(mixed.dequantize(), torch.cat([q4k.dequantize(), q4.dequantize()]))
    layer = QuantLinear(None, None, cat_4bit([q4k, q4k]), cpu_backend())
    both = x.float() @ torch.cat([q4k.dequantize()] * 2).T
    assert relative_error(layer(x), both) < 0.02
    q6 = random_q6(48, 512)
    six = Q6Linear(q6, torch.ones(48, dtype=torch.bfloat16), kernel_ops())
    y = torch.randn(2, 512).bfloat16()
    assert six(y).dtype == torch.bfloat16
    assert relative_error(six(y) - 1, y.float() @ q6.dequantize().T) < 0.02


def test_a_q6_k_output_head_multiplies_its_own_codes(at_isa):
    """A Q6_K head (a Q4_K_M file's): logits from its 6-bit tiles, the top candidates
    recomputed from its Q8_0 rounding (the rows the embedding reads), as a Q8_0 head's are."""
    from pagedllm.models.output_head import Q8Head, output_head
    from pagedllm.weights.q8 import quantize_q8_0

    q6 = random_q6(272, 256, seed=3)
    weight = q6.dequantize()
    q8 = quantize_q8_0(weight)
    head = output_head(weight, q8, 16, cpu_backend(), q6)
    assert isinstance(head, Q8Head) and head.packed.shape[-1] == 3360
    torch.manual_seed(0)
    hidden = torch.randn(3, 256).bfloat16().float()  # the head multiplies bfloat16 rows
    logits = head(hidden)
    assert logits.dtype == torch.float32 and logits.shape == (3, 272)
    exact = hidden @ weight.T
    assert relative_error(logits, exact) < 0.02
    rounded = hidden @ q8.rows(torch.arange(272)).T
    top = logits.topk(16, dim=-1).indices
    assert torch.allclose(logits.gather(1, top), rounded.gather(1, top), rtol=1e-4, atol=1e-4)
    assert torch.equal(logits.argmax(-1), rounded.argmax(-1))
