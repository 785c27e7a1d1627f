"""The low-bit linear layers: 4-bit GGUF codes through torch's int4 kernel, int8 output head.
Both must agree with the dense product of the weights they stand for, at every row count."""
import pytest
import torch

from pagedllm.models.quant_linear import (INT4_MAX_ROWS, INT8_MAX_ROWS, Int8Linear, QuantLinear,
                                          int4_available, int8_available)
from pagedllm.weights.q4 import GROUP_SIZE, Q4Weight


def relative_error(approx: torch.Tensor, exact: torch.Tensor) -> float:
    return ((approx.float() - exact).norm() / exact.norm()).item()


@pytest.mark.skipif(not int4_available(), reason="torch without the CPU int4 kernel")
@pytest.mark.parametrize("rows", [1, INT4_MAX_ROWS, INT4_MAX_ROWS + 1, 64])
def test_int4_layer_matches_dequantized_weights(rows):
    torch.manual_seed(0)
    out, cols = 96, 128
    q4 = Q4Weight(torch.randint(0, 16, (out, cols), dtype=torch.uint8),
                  torch.rand(out, cols // GROUP_SIZE) * 0.02, torch.randn(out, cols // GROUP_SIZE) * 0.01)
    weight = q4.dequantize()
    bias = torch.randn(out).bfloat16()
    layer = QuantLinear(weight.bfloat16(), bias, q4)
    x = torch.randn(rows, cols)
    exact = x @ weight.T + bias.float()
    assert relative_error(layer(x.bfloat16()), exact) < 0.02  # bf16 activations


@pytest.mark.skipif(not int8_available(), reason="torch without the CPU int8 kernel")
@pytest.mark.parametrize("rows", [1, INT8_MAX_ROWS, INT8_MAX_ROWS + 1])
def test_int8_head_matches_float_weights(rows):
    torch.manual_seed(1)
    weight = torch.randn(1000, 64)
    weight[3] *= 50  # one large row: scales are per row, so the others keep their precision
    layer = Int8Linear(weight)
    assert layer.codes.dtype == torch.int8 and layer.codes.abs().max() <= 127
    x = torch.randn(rows, 64)
    exact = x @ weight.T
    approx = layer(x.bfloat16()).float()
    assert relative_error(approx[:, :3], exact[:, :3]) < 0.02
    assert relative_error(approx, exact) < 0.02


def test_int8_head_survives_an_all_zero_row():
    weight = torch.randn(16, 32)
    weight[5] = 0
    out = Int8Linear(weight)(torch.randn(2, 32).bfloat16())
    assert out.isfinite().all() and (out[:, 5] == 0).all()


@pytest.mark.parametrize("rows", [1, 17, 300])
def test_prepacked_dense_linear_is_bit_identical_to_f_linear(rows):
    from pagedllm.models.quant_linear import DenseLinear

    torch.manual_seed(2)
    weight, bias = torch.randn(96, 64).bfloat16(), torch.randn(96).bfloat16()
    x = torch.randn(rows, 64).bfloat16()
    layer = DenseLinear(weight, bias)
    assert layer.prepacked == torch.backends.mkldnn.is_available()
    assert torch.equal(layer(x), torch.nn.functional.linear(x, weight, bias))
    assert torch.equal(DenseLinear(weight, None)(x), torch.nn.functional.linear(x, weight))
    assert not DenseLinear(weight.float(), None).prepacked  # float32 stays plain


def test_prepacked_dense_linear_lets_the_original_weight_go():
    """nn.Linear weights require grad; packing them must not keep them alive (it once did,
    through autograd, and cost 212 MB of resident memory on the default model)."""
    import gc
    import weakref

    from pagedllm.models.quant_linear import DenseLinear

    weight = torch.nn.Parameter(torch.randn(64, 32).bfloat16())
    original = weakref.ref(weight)
    layer = DenseLinear(weight, None)
    del weight
    gc.collect()
    assert original() is None
    assert layer(torch.randn(2, 32).bfloat16()).shape == (2, 64)
