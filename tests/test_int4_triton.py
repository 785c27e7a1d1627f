"""4-bit weights kept 4-bit on the generic backend's device (models/int4_triton.py,
`--gpu-4bit-weights`): the Triton kernel (here under its interpreter, on a GPU compiled:
scripts/gpu_check.sh runs this file with PAGEDLLM_TEST_DEVICE=cuda) and the dequantizing
path give the file's weights' products, and a model built with them answers as the dense one.
"""
from __future__ import annotations

from gpu_path import DEVICE, ON as TENSOR_DEVICE, skip_without_the_gpu  # (before Triton)

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from pagedllm.models.int4_triton import GEMV_MAX_ROWS, Int4Linear, pack_codes  # noqa: E402
from pagedllm.weights.q4 import Q4KWeight, Q4Weight, decode_q4_k  # noqa: E402
from tiny_models import random_k_quant_blocks  # noqa: E402

skip_without_the_gpu()


def q4_0(rows: int, cols: int, seed: int = 0) -> Q4Weight:
    g = torch.Generator().manual_seed(seed)
    d = torch.rand(rows, cols // 32, generator=g) * 0.02 + 0.001
    return Q4Weight(torch.randint(0, 16, (rows, cols), generator=g, dtype=torch.uint8), d, -8 * d)


def q4_1(rows: int, cols: int, seed: int = 1) -> Q4Weight:
    g = torch.Generator().manual_seed(seed)
    return Q4Weight(torch.randint(0, 16, (rows, cols), generator=g, dtype=torch.uint8),
                    torch.rand(rows, cols // 32, generator=g) * 0.02,
                    torch.randn(rows, cols // 32, generator=g) * 0.05)


def q4_k(rows: int, cols: int) -> Q4KWeight:
    return decode_q4_k(random_k_quant_blocks("Q4_K", rows, cols, seed=2), (rows, cols))


def test_codes_pack_two_to_a_byte_and_come_back_exactly():
    weight = q4_1(5, 64)
    packed = pack_codes(weight.codes)
    assert packed.shape == (5, 32) and packed.dtype == torch.uint8
    assert int(packed[0, 0]) == int(weight.codes[0, 0]) | int(weight.codes[0, 1]) << 4
    assert torch.equal(Int4Linear(weight).dequantize(torch.float32), weight.dequantize())


@pytest.mark.parametrize("make", [q4_0, q4_1, q4_k], ids=["Q4_0", "Q4_1", "Q4_K"])
@pytest.mark.parametrize("rows", [1, 3, GEMV_MAX_ROWS, GEMV_MAX_ROWS + 1, 20, 70])
def test_products_equal_the_files_weights(make, rows):
    """Every row count (the GEMV up to GEMV_MAX_ROWS, the product kernel above, 70: two row
    tiles of 64), outputs
    not a multiple of the tile (100), inputs not a multiple of two groups (96 = 3 x 32 for
    Q4_0/Q4_1; Q4_K's super-blocks make it 256), with a bias."""
    cols = 256 if make is q4_k else 96
    weight = make(100, cols)
    bias = torch.randn(100)
    layer = Int4Linear(weight, bias).to(TENSOR_DEVICE)
    dense = weight.dequantize()
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows)).to(dtype)
        got = layer(x.to(TENSOR_DEVICE)).cpu()
        want = x.float() @ dense.T + bias
        assert got.dtype == dtype and got.shape == (rows, 100)
        # bf16: the output's rounding (and the weights', rounded to bf16 above the GEMV's rows);
        # float32: summing `cols` products in float32, in any order, stays within
        # cols * eps of the sum of their magnitudes (which reach ~100 here: an absolute bound
        # failed on an H200)
        magnitude = (x.float().abs() @ dense.abs().T).max() + bias.abs().max()
        tolerance = (2e-2 * want.abs().max() if dtype == torch.bfloat16
                     else cols * torch.finfo(torch.float32).eps * magnitude)
        assert (got.float() - want).abs().max() <= tolerance, (rows, dtype)


def test_leading_dimensions_are_kept():
    layer = Int4Linear(q4_0(64, 64)).to(TENSOR_DEVICE)
    x = torch.randn(2, 3, 64, device=TENSOR_DEVICE)
    assert layer(x).shape == (2, 3, 64)
    assert torch.allclose(layer(x).cpu(), layer(x.view(6, 64)).view(2, 3, 64).cpu())


def test_rows_not_whole_groups_are_refused():
    codes = torch.zeros(4, 40, dtype=torch.uint8)
    with pytest.raises(ValueError, match="not whole groups of 32"):
        Int4Linear(Q4Weight(codes, torch.ones(4, 1), torch.zeros(4, 1)))


@pytest.fixture(scope="module")
def q4_gguf(tmp_path_factory):
    from tiny_models import tiny_hf_model, write_gguf

    model = tiny_hf_model("llama", tie=True, seed=7)
    return write_gguf(model, tmp_path_factory.mktemp("q4") / "tiny-q4_0.gguf", qtype="Q4_0")


def test_a_model_keeps_its_4bit_projections_4bit_and_answers_as_the_dense_one(q4_gguf):
    from pagedllm import LLM, SamplingParams

    device = "cuda" if DEVICE == "cuda" else "torch-cpu"
    kwargs = dict(dtype="bfloat16", kv_cache_memory=8 << 20, device=device)
    four_bit = LLM(q4_gguf, gpu_4bit_weights=True, **kwargs)
    dense = LLM(q4_gguf, **kwargs)
    layers = four_bit.engine.runner.model.stack.layers
    assert all(isinstance(getattr(getattr(layer, part), name), Int4Linear)
               for layer in layers for part, name in (("self_attn", "qkv_proj"),
                                                      ("self_attn", "o_proj"),
                                                      ("mlp", "gate_up_proj"), ("mlp", "down_proj")))
    held = lambda llm: sum(t.numel() * t.element_size()  # noqa: E731
                           for t in [*llm.engine.runner.model.stack.parameters(),
                                     *llm.engine.runner.model.stack.buffers()])
    assert held(four_bit) < 0.6 * held(dense)
    prompts = [[5, 9, 14, 200, 31, 7, 7, 8], [40, 41, 42], list(range(60, 100))]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ours = [o.token_ids for o in four_bit.generate(prompts, params)]
    theirs = [o.token_ids for o in dense.generate(prompts, params)]
    # bf16 weights round (dense) where the kernel multiplies the exact ones: the first
    # tokens agree; later ones may part where two candidates were near.
    assert [t[:4] for t in ours] == [t[:4] for t in theirs]
    agree = np.mean([a == b for x, y in zip(ours, theirs) for a, b in zip(x, y)])
    assert agree >= 0.75


def test_4bit_weights_on_the_cpu_backend_or_in_float32_are_refused(q4_gguf):
    from pagedllm import LLM

    with pytest.raises(ValueError, match="--gpu-4bit-weights needs --device cuda"):
        LLM(q4_gguf, dtype="bfloat16", kv_cache_memory=8 << 20, device="cpu",
            gpu_4bit_weights=True)
    with pytest.raises(ValueError, match="--gpu-4bit-weights needs --dtype bfloat16"):
        LLM(q4_gguf, dtype="float32", kv_cache_memory=8 << 20, device="torch-cpu",
            gpu_4bit_weights=True)


@pytest.mark.parametrize("mix", [False, True], ids=["Q4_0", "Q4_K-with-Q6_K-v"])
def test_plan_counts_the_weights_the_model_holds(tmp_path, mix):
    """`plan --device cuda --gpu-4bit-weights` counts what the loaded model holds, byte for
    byte: 4-bit projections as codes and scales, a q/k/v with a 6-bit v (a Q4_K_M file's)
    dense, as the loader fuses them."""
    from pagedllm import LLM
    from pagedllm.weights.inspect import summarize_checkpoint
    from tiny_models import tiny_hf_model, write_gguf

    from test_gguf_low_bit import tiny_model  # rows k-quants can hold

    model = tiny_model(7) if mix else tiny_hf_model("llama", tie=True, seed=7)
    path = write_gguf(model, tmp_path / "tiny.gguf", qtype="Q4_K" if mix else "Q4_0",
                      qtypes={"attn_v.weight": "Q6_K"} if mix else None)
    llm = LLM(path, dtype="bfloat16", kv_cache_memory=8 << 20, gpu_4bit_weights=True,
              device="cuda" if DEVICE == "cuda" else "torch-cpu")
    net = llm.engine.runner.model
    held = sum(t.numel() * t.element_size()
               for t in [*net.stack.parameters(), *net.stack.buffers(), net.embedding.weight])
    summary = summarize_checkpoint(path)
    assert summary.weight_bytes(2, four_bit_on_device=True) == held
    assert summary.weight_bytes(2) > held  # dense, the plan without the option
    fused_qkv = net.stack.layers[0].self_attn.qkv_proj
    assert isinstance(fused_qkv, Int4Linear) != mix


def test_plan_says_the_serve_command_with_the_option(q4_gguf):
    import json
    import subprocess
    import sys

    run = lambda *flags: subprocess.run(  # noqa: E731
        [sys.executable, "-m", "pagedllm.cli", "plan", "--model", q4_gguf, "--context", "256",
         "--parallel", "1,4", *flags], capture_output=True, text=True, timeout=120)
    dense = run("--device", "cuda", "--memory", "1GiB", "--json")
    four = run("--device", "cuda", "--memory", "1GiB", "--json", "--gpu-4bit-weights")
    assert dense.returncode == four.returncode == 0, four.stderr
    assert json.loads(four.stdout)["weight_bytes"] < json.loads(dense.stdout)["weight_bytes"]
    shown = run("--device", "cuda", "--memory", "1GiB", "--gpu-4bit-weights")
    assert "--device cuda --gpu-4bit-weights" in " ".join(shown.stdout.split())  # (wrapped)
    refused = run("--gpu-4bit-weights")
    assert refused.returncode == 2 and "give --device cuda" in refused.stderr
