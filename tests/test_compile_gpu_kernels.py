"""The compile check for real cards (scripts/compile_gpu_kernels.py, run by `make test` after
the suite): a launch recorded under Triton's interpreter compiles for sm_90 with its
registers and spills read from the cubin; a launch that cannot compile, and a kernel no test
launches, fail the check by name."""
from __future__ import annotations

from gpu_path import ON  # (first: it switches Triton's interpreter on)

import json  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

import triton_launches  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "compile_gpu_kernels.py")
SILU = "pagedllm.backends.triton_layer_ops:_silu_and_mul"


def test_a_launch_is_recorded_as_triton_specializes_it():
    from pagedllm.backends.triton_layer_ops import _silu_and_mul

    gate_up = torch.empty(3, 2 * 96, dtype=torch.bfloat16, device=ON)
    record = triton_launches.launch_record(_silu_and_mul.fn, (gate_up, gate_up[:, 1:], 96, 192),
                                           {"stride_o": 1, "BLOCK": 128, "num_warps": 4})
    assert record == {"kernel": SILU, "options": {"num_warps": 4}, "args": {
        "gate_up_ptr": {"tensor": "bfloat16", "aligned": True},
        "out_ptr": {"tensor": "bfloat16", "aligned": False},  # 2 bytes past a 16-byte line
        "width": 16,  # 96 (a multiple of 16), as Triton specializes it
        "stride_g": 16, "stride_o": 1, "BLOCK": 128}}


def test_an_unrecordable_argument_is_named():
    with pytest.raises(TypeError, match="of type list"):
        triton_launches.describe([1, 2], constexpr=False)


def _check(tmp_path, records: list[dict]) -> tuple[subprocess.CompletedProcess, dict]:
    launches, report = tmp_path / "launches.json", tmp_path / "report.json"
    launches.write_text(json.dumps(records))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compiled for real
    run = subprocess.run([sys.executable, SCRIPT, str(launches), "--archs", "90", "--json",
                          str(report)], capture_output=True, text=True, env=env, timeout=600)
    return run, json.loads(report.read_text())


def test_launches_compile_for_sm90_and_failures_are_named(tmp_path):
    good = {"kernel": SILU, "options": {}, "args": {
        "gate_up_ptr": {"tensor": "bfloat16", "aligned": True},
        "out_ptr": {"tensor": "bfloat16", "aligned": True},
        "width": 16, "stride_g": 16, "stride_o": 16, "BLOCK": 128}}
    # tl.arange needs a power of two: this one is refused by Triton's compiler
    broken = {**good, "args": {**good["args"], "BLOCK": 96}}
    run, report = _check(tmp_path, [good, broken])
    assert run.returncode == 1, run.stdout + run.stderr
    ok, failed = report["rows"]
    assert ok["arch"] == 90 and ok["registers"] > 0 and ok["local"] == 0 and "error" not in ok
    assert "error" in failed
    failures = report["failures"]
    assert any(f.startswith(f"{SILU} sm_90 does not compile") and '"BLOCK": 96' in f
               for f in failures)
    # only one kernel was launched here: every other one of pagedllm's is named
    unlaunched = {f.split()[0] for f in failures if "is launched by no test" in f}
    assert "pagedllm.attention.triton_tiles:_paged_attention" in unlaunched
    assert SILU not in unlaunched
    assert "pagedllm.attention.triton_tiles:_dot" not in unlaunched  # a helper, called inside
    assert "FAIL:" in run.stdout and SILU in run.stdout
