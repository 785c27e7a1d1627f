"""This host's peaks (kernels/roof.cpp) at every level it runs, and benchmarks/roof.py, which
prints each kernel's and each served step's share of them, run end to end on a small load."""
import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_peaks_count_the_work_they_did(ops, isa):
    threads = torch.get_num_threads()
    # multiply-adds a chain step: vpdpbusd 64, vpmaddubsw 32, the portable loop 64; 6 chains
    per_step = {"avx512": 64, "avx2": 32, "portable": 64}[isa]
    assert ops.roof_int8(100) == per_step * 6 * 100 * threads
    assert ops.roof_int8(0) == 0
    lanes = {"avx512": 16, "avx2": 8, "portable": 16}[isa]
    assert ops.roof_fma(100) == lanes * 12 * 100 * threads


def test_the_read_peak_reads_every_byte(ops):
    buffer = torch.zeros(1 << 20, dtype=torch.uint8)
    assert ops.roof_read(buffer) == 0
    buffer[1000] = 7  # the low byte of word 125: the XOR of all words is 7
    assert ops.roof_read(buffer) == 7
    buffer[(1 << 20) - 1] = 1  # the last byte, the top of the last word
    assert ops.roof_read(buffer) == 7 + (1 << 56)
    with pytest.raises(RuntimeError, match="uint8"):
        ops.roof_read(torch.zeros(256, dtype=torch.float32))


def test_the_roof_benchmark_prints_every_share(tmp_path):
    out = tmp_path / "roof.json"
    run = subprocess.run([sys.executable, "benchmarks/roof.py", "--threads", "1", "--rows", "1,2",
                          "--shapes", "135M", "--steps", "1", "--read-mib", "64",
                          "--max-tokens", "8", "--json", str(out)],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    report = json.loads(out.read_text())
    assert set(report["peaks"]) == {"int8_gmacs", "fma_gmacs", "read_gbs"}
    assert all(value > 0 for value in report["peaks"].values())
    assert [(k["rows"], k["product"]) for k in report["kernels"]] == [
        (rows, product) for rows in (1, 2) for product in ("q4_q8_gemm", "q4_i16_gemm", "q4_gemm")]
    assert all(k["ms"] > 0 and k["int8_share"] > 0 and k["read_share"] > 0 for k in report["kernels"])
    [step] = report["steps"]
    assert step["n"] == 1 and step["ms"] > 0 and step["read_share"] > 0
    assert "peaks (best of before and after): int8" in run.stdout
    assert "served decode step N=  1" in run.stdout
    assert report["peaks"]["int8_gmacs"] == max(report["peaks_before"]["int8_gmacs"],
                                                report["peaks_after"]["int8_gmacs"])


def test_a_q4_k_shape_packs_its_projections_two_level(ops, monkeypatch):
    """SHAPE-Q4_K measures the kernels on Q4_K tiles (what a Q4_K_M file's 4-bit parts are),
    the bare shape on per-group ones; the product reads either."""
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    import roof

    monkeypatch.setitem(roof.SHAPES, "tiny", ([(32, 512), (16, 256)], 2))
    two_level, per_group = roof.packed_layers(ops, "tiny-Q4_K"), roof.packed_layers(ops, "tiny")
    assert [(p.shape, inp) for p, inp in two_level] == [((2, 2, 2368), 512), ((1, 1, 2368), 256)] * 2
    assert [(p.shape, inp) for p, inp in per_group] == [((2, 16, 320), 512), ((1, 8, 320), 256)] * 2
    x = torch.randn(3, 512).bfloat16()
    assert ops.q4_q8_gemm(x, two_level[0][0]).shape == (3, 32)
