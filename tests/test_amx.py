"""AMX tiles for the steps with many rows (kernels/cpu.py, models/quant_linear.py): 4-bit
weights dequantized to bfloat16 (kernels/q4_dequant.cpp) exactly as the reference does, at
every CPU level; the product through oneDNN against the exact 4-bit kernel; the choice made
at run time (the CPU's flags, the OS's permission, PAGEDLLM_CPU_AMX) and its fallback; and
the real model's answers with the tiles on and off."""
import dataclasses

import numpy as np
import pytest
import torch

from pagedllm.backends import cpu_backend
from pagedllm.kernels import capabilities, cpu
from pagedllm.models.quant_linear import AMX_MIN_ROWS, QuantLinear
from pagedllm.weights.q4 import Q4Weight, decode_q4_k
from tiny_models import random_k_quant_blocks

HOST_HAS_AMX = capabilities().amx
WHY_NOT = "this host has no AMX tiles in use (no amx_tile/amx_bf16, or a level below avx512)"


def q4_1(rows: int, cols: int, seed: int = 0) -> Q4Weight:
    g = torch.Generator().manual_seed(seed)
    d = (torch.rand(rows, cols // 32, generator=g) * 0.02).half().float()
    m = (-torch.rand(rows, cols // 32, generator=g) * 0.1).half().float()
    return Q4Weight(torch.randint(0, 16, (rows, cols), generator=g, dtype=torch.uint8), d, m)


def q4_k(rows: int, cols: int, seed: int = 0):
    raw = np.frombuffer(random_k_quant_blocks("Q4_K", rows, cols, seed).tobytes(), dtype=np.uint8)
    return decode_q4_k(raw, (rows, cols))


@pytest.mark.parametrize("make, shape", [(q4_1, (32, 64)), (q4_1, (960, 576)),
                                         (q4_k, (48, 512)), (q4_k, (64, 1536))])
def test_dequantizing_gives_the_references_bfloat16_weights_at_every_level(ops, make, shape):
    weight = make(*shape)
    expected = weight.dequantize().to(torch.bfloat16).T
    assert torch.equal(ops.lowbit_dequantize(weight.kernel_pack(ops), shape[1], None), expected)
    buffer = torch.empty(shape[1], shape[0], dtype=torch.bfloat16)
    assert ops.lowbit_dequantize(weight.kernel_pack(ops), shape[1], buffer).data_ptr() == \
        buffer.data_ptr()
    assert torch.equal(buffer, expected)


def q8_0(rows: int, cols: int, seed: int = 0):
    from pagedllm.weights.q8 import Q8Rows

    g = torch.Generator().manual_seed(seed)
    return Q8Rows(torch.randint(-127, 128, (rows, cols), generator=g, dtype=torch.int8),
                  (torch.rand(rows, cols // 32, generator=g) * 0.01).half().float())


@pytest.mark.parametrize("shape", [(32, 64), (960, 576)])
def test_dequantizing_q8_0_gives_the_references_bfloat16_weights_at_every_level(ops, shape):
    weight = q8_0(*shape)
    packed = ops.q8_pack(weight.codes, weight.scales)
    expected = weight.rows(torch.arange(shape[0])).to(torch.bfloat16).T
    assert torch.equal(ops.lowbit_dequantize(packed, shape[1], None), expected)


def test_dequantizing_refuses_what_does_not_fit(ops):
    packed = q4_1(32, 64).kernel_pack(ops)
    with pytest.raises(RuntimeError, match="k must be the packed weight's inputs, 64"):
        ops.lowbit_dequantize(packed, 32, None)
    with pytest.raises(RuntimeError, match=r"out must be \[64, 32\] bfloat16"):
        ops.lowbit_dequantize(packed, 64, torch.empty(32, 64, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="packed must be a 4-bit or Q8_0 weight"):
        ops.lowbit_dequantize(torch.zeros(2, 2, 7, dtype=torch.uint8), 64, None)


@pytest.fixture()
def amx_backend():
    """The CPU backend as an AMX host has it (the path's logic runs on any CPU: oneDNN's
    bfloat16 product; on an AMX host it runs on the tiles)."""
    backend = cpu_backend()
    if backend.kernels is None:
        pytest.skip("the C++ kernels are not built here")
    return dataclasses.replace(backend, cpu=dataclasses.replace(backend.cpu, amx=True))


@pytest.mark.parametrize("make", [q4_1, q4_k])
def test_many_rows_go_to_the_tiles_and_agree_with_the_exact_kernel(amx_backend, make):
    weight = make(256, 512)
    tiles = QuantLinear(None, None, weight, amx_backend, int8_activations=False)
    no_tiles = dataclasses.replace(amx_backend, cpu=dataclasses.replace(amx_backend.cpu, amx=False))
    exact = QuantLinear(None, None, weight, no_tiles, int8_activations=False)
    assert tiles.amx_min_rows == AMX_MIN_ROWS and exact.amx_min_rows > 10**9
    x = torch.randn(AMX_MIN_ROWS + 3, 512).to(torch.bfloat16)
    got, expected = tiles(x).float(), exact(x).float()
    # the weights rounded to bfloat16 once: as a dense bfloat16 layer's
    reference = x.float() @ weight.dequantize().to(torch.bfloat16).float().T
    relative = lambda a, b: ((a - b).norm() / b.norm()).item()  # noqa: E731
    assert relative(got, reference) < 0.005  # (the output's own bfloat16 rounding)
    assert relative(got, expected) < 0.01
    few = x[:AMX_MIN_ROWS - 1]  # fewer rows: the 4-bit kernel, bit for bit
    assert torch.equal(tiles(few), exact(few))
    assert amx_backend.scratch  # one buffer a shape, shared by the layers


def test_q8_0_rows_go_to_the_tiles_too(amx_backend):
    from pagedllm.models.quant_linear import Q8Linear

    weight = q8_0(256, 512)
    tiles = Q8Linear(weight, None, amx_backend.kernels, amx_backend)
    kernel = Q8Linear(weight, None, amx_backend.kernels)  # no backend: the int8 kernel only
    assert tiles.amx is not None and kernel.amx is None
    x = torch.randn(AMX_MIN_ROWS, 512).to(torch.bfloat16)
    reference = x.float() @ weight.rows(torch.arange(256)).to(torch.bfloat16).float().T
    relative = lambda a, b: ((a.float() - b).norm() / b.norm()).item()  # noqa: E731
    assert relative(tiles(x), reference) < 0.005
    assert relative(kernel(x), reference) < 0.02  # (its activations rounded to int8)
    assert torch.equal(tiles(x[:8]), kernel(x[:8]))  # few rows: the int8 kernel


def test_the_tiles_are_used_where_the_cpu_has_them_and_the_os_grants_them(monkeypatch):
    flags = frozenset(cpu.REQUIRED_FLAGS["avx512"] | cpu.AMX_FLAGS)
    monkeypatch.setattr(cpu, "cpu_flags", lambda: flags)
    monkeypatch.setattr(cpu.platform, "machine", lambda: "x86_64")
    monkeypatch.delenv(cpu.AMX_ENV_VAR, raising=False)
    monkeypatch.setattr(cpu, "amx_tiles_granted", lambda: True)
    assert cpu.detect("").summary == "avx512+amx"
    monkeypatch.setattr(cpu, "amx_tiles_granted", lambda: False)  # the OS refuses the state
    refused = cpu.detect("")
    assert not refused.amx and refused.has_amx and refused.summary == "avx512"
    monkeypatch.setattr(cpu, "amx_tiles_granted", lambda: True)
    assert not cpu.detect("avx2").amx  # a lower level: no tiles either
    monkeypatch.setenv(cpu.AMX_ENV_VAR, "0")
    assert not cpu.detect("").amx
    monkeypatch.setattr(cpu, "cpu_flags", lambda: frozenset(cpu.REQUIRED_FLAGS["avx512"]))
    monkeypatch.delenv(cpu.AMX_ENV_VAR)
    assert not cpu.detect("").amx  # no tiles in the CPU


@pytest.mark.skipif(not HOST_HAS_AMX, reason=WHY_NOT)
def test_onednn_runs_the_product_on_the_tiles(tmp_path):
    import subprocess
    import sys

    probe = ("import torch; x = torch.randn(256, 512).bfloat16(); "
             "w = torch.randn(512, 256).bfloat16(); torch.matmul(x, w)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         env={"ONEDNN_VERBOSE": "1", "PATH": "/usr/bin:/bin"}, timeout=120)
    assert "amx" in out.stdout, out.stdout[-2000:]


@pytest.mark.slow
@pytest.mark.skipif(not HOST_HAS_AMX, reason=WHY_NOT)
def test_the_default_model_answers_alike_with_the_tiles_and_without(monkeypatch):
    from pagedllm import LLM, SamplingParams

    prompts = ["The capital of France is", "Write a haiku about the sea. " * 20]
    params = SamplingParams(temperature=0, max_tokens=12)
    with_tiles = LLM(dtype="bfloat16", kv_cache_memory=64 << 20)
    assert with_tiles.engine.cpu.amx
    tiled = [o.token_ids for o in with_tiles.generate(prompts, params)]
    del with_tiles
    monkeypatch.setenv(cpu.AMX_ENV_VAR, "0")
    without = LLM(dtype="bfloat16", kv_cache_memory=64 << 20)
    assert not without.engine.cpu.amx
    plain = [o.token_ids for o in without.generate(prompts, params)]
    # the short prompt never reaches the tiles: the same tokens; the long one's prefill
    # (its weights rounded to bfloat16) agrees on the first tokens at least
    assert tiled[0] == plain[0]
    assert tiled[1][:4] == plain[1][:4]
