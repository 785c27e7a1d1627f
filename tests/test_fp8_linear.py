"""A bfloat16 model's projections as float8 on the generic backend (`--gpu-fp8-weights`,
models/fp8_linear.py): the product against the same rounding done by hand and against the
dense matrix, its edges (zero rows, no rows, sides that do not fit), the engine built with
it answering as the dense one, and the refusals. On the CPU here (torch._scaled_mm runs
there); on a GPU by scripts/gpu_check.sh."""
from __future__ import annotations

from gpu_path import DEVICE, ON as TENSOR_DEVICE  # (first: it switches Triton's interpreter on)

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from pagedllm.models.fp8_linear import E4M3, E4M3_MAX, Fp8Linear, fits, quantize_rows  # noqa: E402


def relative(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_rows_are_scaled_to_e4m3s_range():
    x = torch.tensor([[1.0, -2.0, 0.5, 4.0], [0.0, 0.0, 0.0, 0.0], [-3e-3, 1e-3, 0, 2e-3]])
    codes, scale = quantize_rows(x)
    assert codes.dtype == E4M3 and scale.shape == (3, 1) and scale.dtype == torch.float32
    assert codes.float()[0].abs().max() == E4M3_MAX == 448  # each row's largest is 448
    assert codes.float()[2].abs().max() == 448
    assert scale[1].item() == 1.0 and torch.equal(codes.float()[1], torch.zeros(4))
    back = codes.float() * scale
    assert (back - x).abs().max() <= x.abs().amax(dim=1, keepdim=True).max() / 16  # 3 bits


def test_the_product_is_the_rounded_operands_product():
    """Exactly what the codes and scales say (to the bfloat16 output's rounding), and near the
    dense product (e4m3's rounding of both operands)."""
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 64, generator=g) * 0.05
    bias = torch.randn(96, generator=g)
    x = torch.randn(2, 5, 64, generator=g).bfloat16()
    layer = Fp8Linear(weight, bias).to(TENSOR_DEVICE)
    got = layer(x.to(TENSOR_DEVICE)).cpu()
    assert got.dtype == torch.bfloat16 and got.shape == (2, 5, 96)
    codes, scale = quantize_rows(x.reshape(10, 64))
    by_hand = (codes.double() * scale.double()) @ layer.dequantize().cpu().double().T
    by_hand = by_hand.reshape(2, 5, 96) + bias.double()
    assert relative(got, by_hand) < 4e-3  # the output's bfloat16 rounding
    dense = x.float() @ weight.T + bias
    assert 1e-3 < relative(got, dense) < 0.06  # rounded, and not by much
    assert layer.codes.dtype == E4M3 and layer.codes.shape == (96, 64)
    assert layer.scale.shape == (1, 96)


def test_no_rows_zero_rows_and_sides_that_do_not_fit():
    layer = Fp8Linear(torch.randn(32, 48)).to(TENSOR_DEVICE)
    assert layer(torch.empty(0, 48, dtype=torch.bfloat16, device=TENSOR_DEVICE)).shape == (0, 32)
    zero = layer(torch.zeros(3, 48, dtype=torch.bfloat16, device=TENSOR_DEVICE))
    assert torch.equal(zero.cpu(), torch.zeros(3, 32, dtype=torch.bfloat16))
    assert fits(torch.empty(32, 48)) and not fits(torch.empty(30, 48))
    assert not fits(torch.empty(32, 40)) and not fits(torch.empty(32))
    with pytest.raises(ValueError, match="multiples of 16, got \\(32, 40\\)"):
        Fp8Linear(torch.randn(32, 40))


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    from tiny_models import tiny_hf_model, write_hf_folder

    return write_hf_folder(tiny_hf_model("llama", seed=3), tmp_path_factory.mktemp("fp8"))


def test_a_model_with_fp8_projections_answers_as_the_dense_one(tiny_folder):
    from pagedllm import LLM, SamplingParams
    from pagedllm.models.build import PROJECTIONS

    kwargs = dict(dtype="bfloat16", kv_cache_memory=8 << 20, device=DEVICE)
    fp8 = LLM(tiny_folder, gpu_fp8_weights=True, **kwargs)
    dense = LLM(tiny_folder, **kwargs)
    layers = fp8.engine.runner.model.stack.layers
    assert all(isinstance(getattr(getattr(layer, part), name), Fp8Linear)
               for layer in layers for part, name in PROJECTIONS)
    held = lambda llm: sum(t.numel() * t.element_size()  # noqa: E731
                           for t in [*llm.engine.runner.model.stack.parameters(),
                                     *llm.engine.runner.model.stack.buffers()])
    assert held(fp8) < 0.65 * held(dense)  # a byte a weight, not two (norms stay)
    prompts = [[5, 9, 14, 200, 31, 7, 7, 8], [40, 41, 42], list(range(60, 100))]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ours = [o.token_ids for o in fp8.generate(prompts, params)]
    theirs = [o.token_ids for o in dense.generate(prompts, params)]
    # Rounded weights and activations: the first tokens agree; later ones may part where
    # two candidates were near.
    assert [t[:3] for t in ours] == [t[:3] for t in theirs]
    assert np.mean([a == b for x, y in zip(ours, theirs) for a, b in zip(x, y)]) >= 0.7
    manager = fp8.engine.kv_manager
    assert manager.num_free_blocks == manager.num_blocks


def test_fp8_weights_are_refused_where_they_do_not_apply(tiny_folder):
    from pagedllm import LLM

    kwargs = dict(kv_cache_memory=8 << 20, gpu_fp8_weights=True)
    with pytest.raises(ValueError, match="--gpu-fp8-weights needs --device cuda"):
        LLM(tiny_folder, dtype="bfloat16", device="cpu", **kwargs)
    with pytest.raises(ValueError, match="--gpu-fp8-weights needs --dtype bfloat16"):
        LLM(tiny_folder, dtype="float32", device="torch-cpu", **kwargs)
    with pytest.raises(ValueError, match="exclude each other"):
        LLM(tiny_folder, dtype="bfloat16", device="torch-cpu", gpu_4bit_weights=True, **kwargs)


def test_an_older_card_is_refused(monkeypatch):
    from types import SimpleNamespace

    from pagedllm.config import EngineConfig
    from pagedllm.models.fp8_linear import check_fp8_weights

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    config = EngineConfig("unused", dtype="bfloat16", gpu_fp8_weights=True)
    with pytest.raises(ValueError, match="compute capability 8.9 or later\\); this one has 8.0"):
        check_fp8_weights(config, SimpleNamespace(generic=True, device="cuda"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    check_fp8_weights(config, SimpleNamespace(generic=True, device="cuda"))  # Hopper: taken
