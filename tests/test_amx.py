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
from pagedllm.models.quant_linear import (ALL_ROWS, AMX_EXACT_MIN_ROWS, AMX_FUSED_MAX_ROWS,
                                          AMX_MIN_ROWS, QuantLinear)
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
    few = x[:AMX_MIN_ROWS - 1]  # fewer rows: the exact 4-bit product (on the tiles where
    # this process can use them, summed in another order; else the same kernel, bit for bit)
    if amx_backend.kernels.amx_tiles_usable():
        assert relative(tiles(few).float(), exact(few).float()) < 2e-3
    else:
        assert torch.equal(tiles(few), exact(few))
    assert not amx_backend.scratch  # up to AMX_FUSED_MAX_ROWS: no dense copy was made
    many = torch.randn(AMX_FUSED_MAX_ROWS + 1, 512).to(torch.bfloat16)  # dequantize + oneDNN
    reference = many.float() @ weight.dequantize().to(torch.bfloat16).float().T
    assert relative(tiles(many).float(), reference) < 0.005
    assert amx_backend.scratch  # one buffer a shape, shared by the layers


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def tiles_kernels():
    """The avx512 kernels where their exact 4-bit product runs on the AMX tiles here."""
    if "avx512" not in capabilities().available or not HOST_HAS_AMX:
        pytest.skip(WHY_NOT)
    from pagedllm.kernels import kernels_for

    ops = kernels_for("avx512")
    assert ops.amx_tiles_usable(), "the CPU has the tiles and Linux granted them: usable"
    return ops


@pytest.mark.parametrize("make, shape", [(q4_1, (32, 64)), (q4_1, (48, 576)), (q4_k, (48, 512)),
                                         (q4_k, (64, 1536))])
@pytest.mark.parametrize("rows", [1, 3, 15, 16, 17, 40])
def test_the_exact_product_on_the_tiles_agrees_with_the_reference(make, shape, rows):
    """Group layouts (Q4_0/Q4_1, 576 inputs: 18 groups, not a whole number of the kernel's
    8-group passes) and Q4_K's super-blocks, row counts around the tile's 16."""
    ops = tiles_kernels()
    weight = make(*shape)
    packed = weight.kernel_pack(ops)
    x = torch.randn(rows, shape[1], generator=torch.Generator().manual_seed(rows)).bfloat16()
    got = ops.q4_gemm(x, packed, amx=True)
    reference = x.float() @ weight.dequantize().float().T
    assert got.dtype == torch.bfloat16 and got.shape == (rows, shape[0])
    assert relative(got, reference) < 3e-3  # (the output's own bfloat16 rounding)
    exact = ops.q4_gemm(x, packed)  # the AVX-512 exact tile: the same products, another order
    assert relative(got, exact) < 3e-3 and (got == exact).float().mean() > 0.9
    # A row's result does not depend on the rows beside it (blocks of 16, the shorter last).
    for r in {0, rows - 1, rows // 2}:
        assert torch.equal(ops.q4_gemm(x[r:r + 1], packed, amx=True)[0], got[r])


def test_the_exact_product_on_the_tiles_carries_non_finite_inputs():
    ops = tiles_kernels()
    weight = q4_1(32, 64)
    x = torch.randn(4, 64).bfloat16()
    x[1, 3], x[2, 60] = float("nan"), float("inf")
    got = ops.q4_gemm(x, weight.kernel_pack(ops), amx=True)
    assert got[1].isnan().all() and not got[2].isfinite().any()
    assert got[[0, 3]].isfinite().all()


def test_the_tiles_are_usable_only_at_the_avx512_level_with_the_permission(ops, isa):
    assert ops.amx_tiles_usable() == (isa == "avx512" and HOST_HAS_AMX)
    weight = q4_1(32, 64)
    x = torch.randn(5, 64).bfloat16()
    packed = weight.kernel_pack(ops)
    if not ops.amx_tiles_usable():  # asked for anyway: the exact kernel, bit for bit
        assert torch.equal(ops.q4_gemm(x, packed, amx=True), ops.q4_gemm(x, packed))


@pytest.mark.skipif("avx512" not in capabilities().available or not capabilities().has_amx,
                    reason="this CPU has no AMX tiles")
def test_without_the_permission_the_exact_kernel_runs_instead():
    """A process that never asked Linux for the tiles' state (PAGEDLLM_CPU_AMX=0, and no
    oneDNN product before): the kernels see it and keep the AVX-512 tile, instead of dying
    of SIGILL at the first tile instruction."""
    import subprocess
    import sys

    probe = ("import torch; from pagedllm.kernels import kernels_for, capabilities\n"
             "assert not capabilities().amx\n"
             "ops = kernels_for('avx512'); print('usable', ops.amx_tiles_usable())\n"
             "codes = torch.randint(0, 16, (32, 64), dtype=torch.uint8)\n"
             "packed = ops.q4_pack(codes, torch.full((32, 2), 0.01), torch.zeros(32, 2))\n"
             "x = torch.randn(8, 64).bfloat16()\n"
             "print('equal', torch.equal(ops.q4_gemm(x, packed, amx=True), ops.q4_gemm(x, packed)))")
    import os

    env = dict(os.environ, PAGEDLLM_CPU_AMX="0")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "usable False" in out.stdout and "equal True" in out.stdout


def test_on_the_tiles_every_step_below_onednns_rows_is_exact(amx_backend):
    """With int8 activations allowed (models from 1B parameters), an AMX host still keeps
    them exact up to AMX_MIN_ROWS: the tiles' exact product is the faster one there."""
    weight = q4_k(64, 512)
    tiles = QuantLinear(None, None, weight, amx_backend, int8_activations=True)
    assert tiles.exact_max_rows == ALL_ROWS
    assert tiles.amx_exact_min_rows == max(AMX_EXACT_MIN_ROWS, tiles.int16_max_rows + 1)
    plain = dataclasses.replace(amx_backend, cpu=dataclasses.replace(amx_backend.cpu, amx=False))
    no_tiles = QuantLinear(None, None, weight, plain, int8_activations=True)
    assert no_tiles.exact_max_rows < 100 and no_tiles.amx_exact_min_rows == ALL_ROWS
    x = torch.randn(40, 512).bfloat16()
    reference = x.float() @ weight.dequantize().float().T
    assert relative(tiles(x), reference) < 3e-3
    assert relative(no_tiles(x), reference) > relative(tiles(x), reference)  # int8-rounded


def test_verifying_proposals_multiplies_as_the_requests_plain_step_would():
    """Speculative decoding's verification step holds more rows than requests; the tiles are
    used as a plain decode step of its requests would use them, so the tokens it keeps are
    the ones plain decoding gives, bit for bit (models/decode_loop.py)."""
    from paged_helpers import LoopRowLimits

    limits = LoopRowLimits([ALL_ROWS], AMX_EXACT_MIN_ROWS)
    amx = lambda requests, rows_each: limits.step(requests, rows_each)[1]  # noqa: E731
    assert amx(1, 1) == AMX_EXACT_MIN_ROWS  # plain steps: the kernel decides by rows
    assert amx(1, 5) == ALL_ROWS  # one request verifying 4 proposals: not on the tiles
    assert amx(AMX_EXACT_MIN_ROWS - 1, 3) == ALL_ROWS
    assert amx(AMX_EXACT_MIN_ROWS, 3) == 0  # as many requests as the tiles take: on them


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
    # (its weights rounded to bfloat16) agrees on the first tokens at least (its third is a
    # near tie: float32 puts 3426 0.02 above 808 in log-probability, and bfloat16 activations
    # move the two by more than that)
    assert tiled[0] == plain[0]
    assert tiled[1][:2] == plain[1][:2]


@pytest.mark.skipif(not HOST_HAS_AMX, reason=WHY_NOT)
def test_the_decode_loop_on_the_tiles_is_bit_identical_to_the_python_layers(monkeypatch):
    """The default model with the tiles in use: steps of 1 to 12 decode tokens through the
    C++ loop and through the Python layers give the same logits, bit for bit (both take the
    tiles from AMX_EXACT_MIN_ROWS rows), and close to the model without the tiles."""
    from conftest import amx_off
    from paged_helpers import run_paged
    from pagedllm import LLM

    model = LLM(dtype="bfloat16", kv_cache_memory=64 << 20).engine.runner.model
    loop = model.decode_loop
    assert loop is not None and loop.amx_min_rows == max(AMX_EXACT_MIN_ROWS, loop.int16_max_rows + 1)
    seqs = [[1, 504, 3300, 28, 253, 1135, 30, 216], [9690, 17, 2], list(range(100, 120))] + \
        [[200 + i] * (3 + i) for i in range(9)]
    fast = run_paged(model, seqs, block_size=16, chunk=1)
    with monkeypatch.context() as m:
        m.setattr(model, "decode_loop", None)
        slow = run_paged(model, seqs, block_size=16, chunk=1)
    assert all(torch.equal(f, s) for f, s in zip(fast, slow))
    with amx_off():
        plain = LLM(dtype="bfloat16", kv_cache_memory=64 << 20).engine.runner.model
    assert plain.decode_loop.amx_min_rows == ALL_ROWS
    for f, p in zip(fast, run_paged(plain, seqs, block_size=16, chunk=1)):
        assert (f.argmax(-1) == p.argmax(-1)).float().mean() >= 0.9
        assert relative(f, p) < 0.05  # (bfloat16 activations: 30 layers of rounding)


def q6_k(rows: int, cols: int, seed: int = 0):
    from pagedllm.weights.q6 import decode_q6_k

    raw = np.frombuffer(random_k_quant_blocks("Q6_K", rows, cols, seed).tobytes(), dtype=np.uint8)
    return decode_q6_k(raw, (rows, cols))


@pytest.mark.parametrize("make, shape", [(q4_1, (48, 576)), (q4_k, (64, 512)), (q6_k, (48, 768))])
@pytest.mark.parametrize("rows", [1, 17, 64, 65, 130])
def test_the_fused_product_multiplies_the_weights_rounded_to_bfloat16(make, shape, rows):
    """q4_bf16_gemm / q6_bf16_gemm: the many-row steps' product on the tiles, the weights
    rounded to bfloat16 inside the kernel, as the dense copy oneDNN multiplied rounds them;
    passes of 64 rows (4 C tiles), the last block shorter."""
    ops = tiles_kernels()
    weight = make(*shape)
    six = make is q6_k
    packed = ops.q6_pack(weight.codes, weight.scales, weight.d) if six else weight.kernel_pack(ops)
    x = torch.randn(rows, shape[1], generator=torch.Generator().manual_seed(rows)).bfloat16()
    got = (ops.q6_bf16_gemm if six else ops.q4_bf16_gemm)(x, packed)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, shape[0])
    rounded = weight.dequantize().to(torch.bfloat16).float()
    assert relative(got, x.float() @ rounded.T) < 3e-3  # (the output's own rounding)
    for r in {0, rows - 1}:  # a row's result does not depend on the rows beside it
        assert torch.equal((ops.q6_bf16_gemm if six else ops.q4_bf16_gemm)(x[r:r + 1], packed)[0],
                           got[r])


@pytest.mark.parametrize("make", [q4_k, q6_k])
def test_the_fused_product_takes_many_rows_in_sweeps_that_fit_in_l2(make):
    """Over 8192 inputs a sweep is 64 rows (1 MiB of activations, kernels/amx_tiles.h):
    300 rows are five sweeps, the last shorter, stitched with every row where it belongs and
    each row's result the one it has alone."""
    ops = tiles_kernels()
    weight = make(32, 8192)
    six = make is q6_k
    packed = ops.q6_pack(weight.codes, weight.scales, weight.d) if six else weight.kernel_pack(ops)
    gemm = ops.q6_bf16_gemm if six else ops.q4_bf16_gemm
    x = torch.randn(300, 8192, generator=torch.Generator().manual_seed(5)).bfloat16()
    got = gemm(x, packed)
    rounded = weight.dequantize().to(torch.bfloat16).float()
    assert relative(got, x.float() @ rounded.T) < 3e-3
    for r in (0, 63, 64, 255, 256, 299):
        assert torch.equal(gemm(x[r:r + 1], packed)[0], got[r])


def test_the_fused_products_fall_back_where_the_tiles_are_not_usable(ops):
    if ops.amx_tiles_usable():
        pytest.skip("the tiles are usable at this level: the test above covers them")
    weight, six = q4_k(32, 512), q6_k(32, 512)
    x = torch.randn(3, 512).bfloat16()
    packed = weight.kernel_pack(ops)
    assert torch.equal(ops.q4_bf16_gemm(x, packed), ops.q4_gemm(x, packed))  # exact
    packed6 = ops.q6_pack(six.codes, six.scales, six.d)
    assert torch.equal(ops.q6_bf16_gemm(x, packed6), ops.q6_gemm(x, packed6).bfloat16())


def test_q6_k_rows_go_to_the_tiles_from_onednns_rows(amx_backend):
    from pagedllm.models.quant_linear import Q6Linear

    weight = q6_k(64, 512)
    tiles = Q6Linear(weight, None, amx_backend.kernels, amx_backend)
    kernel = Q6Linear(weight, None, amx_backend.kernels)  # no backend: the int8 kernel only
    assert tiles.tiles_gemm is not None and kernel.tiles_gemm is None
    x = torch.randn(AMX_MIN_ROWS, 512).bfloat16()
    reference = x.float() @ weight.dequantize().to(torch.bfloat16).float().T
    if HOST_HAS_AMX:
        assert relative(tiles(x), reference) < 3e-3
    else:  # no tiles to run on: q6_bf16_gemm is the int8 kernel's product, rounded
        assert torch.equal(tiles(x), kernel(x).bfloat16())
    assert relative(kernel(x), reference) < 0.02  # (its activations rounded to int8)
    assert torch.equal(tiles(x[:8]), kernel(x[:8]))  # few rows: the int8 kernel
