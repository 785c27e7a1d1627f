"""Kernels per decode step on the GPU's code path (backends/launch_count.py), counted without
a GPU: on an H200 a CUDA-graph decode step cost about its kernel count times a few
microseconds (BENCHMARKS.md, "Kernels per decode step"), so the count is held here, exactly,
where a timing could not be. The counter itself first: views and allocations are not
launches, a Triton kernel is one launch whatever it does inside, scopes nest."""
from __future__ import annotations

from gpu_path import DEVICE, ON, build_engines_as_on_the_gpu, skip_without_the_gpu

import collections  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from pagedllm import LLM, SamplingParams  # noqa: E402
from pagedllm.backends.launch_count import count_launches  # noqa: E402
from pagedllm.backends.triton_layer_ops import TritonLayerOps  # noqa: E402
from tiny_models import tiny_hf_model, write_hf_folder  # noqa: E402

skip_without_the_gpu()


def test_views_and_allocations_are_not_launches_and_ops_are():
    x = torch.randn(4, 6, device=ON)
    with count_launches() as count:
        y = x.view(6, 4).t()[1].reshape(6)[2:5]
        torch.empty(5, device=ON)
        z = (y + 1) * 2
        z.sum()
        x.t().reshape(24)  # a copy: no view can be
    assert count.total == collections.Counter({"add": 1, "mul": 1, "sum": 1, "clone": 1})
    assert count.launches("outside") == count.launches()


def test_a_triton_kernel_is_one_launch_and_its_insides_are_not_counted():
    gate_up = torch.randn(3, 64, device=ON)
    with count_launches() as count:
        out = TritonLayerOps.silu_and_mul(gate_up)
    assert count.total == collections.Counter({"triton:_silu_and_mul": 1})
    # the counter leaves the kernel working, and its launcher as it was after
    gate, up = gate_up.split(32, dim=-1)
    assert torch.allclose(out, torch.nn.functional.silu(gate) * up, atol=1e-5)
    with count_launches() as count:
        pass
    assert count.launches() == 0
    TritonLayerOps.silu_and_mul(gate_up)  # unpatched: nothing counts, nothing fails


def test_scopes_nest_and_each_launch_counts_in_the_innermost_one():
    inner = torch.nn.Linear(4, 4, bias=False)
    outer = torch.nn.Sequential(torch.nn.ReLU(), inner, torch.nn.ReLU())
    with count_launches({"outer": outer, "inner": inner}) as count:
        outer(torch.randn(2, 4))
        torch.randn(2).abs()
    assert count.launches("inner") == 1  # the product (its ATen name varies by version)
    assert count.by_scope["outer"] == collections.Counter({"relu": 2})
    assert count.by_scope["outside"]["abs"] == 1
    assert count.scopes == ["outside"]


@pytest.fixture
def gpu_ops_llm(tmp_path, monkeypatch):
    """A tiny Llama on the CUDA backend's choices (Triton attention and layer ops)."""
    build_engines_as_on_the_gpu(monkeypatch, layer_ops="triton")
    folder = write_hf_folder(tiny_hf_model("llama", seed=5), tmp_path)
    return LLM(folder, dtype="float32", kv_cache_memory=8 << 20, device=DEVICE,
               max_num_seqs=4, cuda_graphs=False)


@pytest.mark.parametrize("batch", [1, 3])
def test_a_decode_layer_launches_nine_kernels_on_the_gpus_path(gpu_ops_llm, batch):
    """The four projections, the two norms (each with its residual add), RoPE with the KV
    write, the attention and SiLU-and-multiply: one launch each, at any batch size; the
    whole step adds the head, the sampler and once-a-step layout copies only."""
    engine = gpu_ops_llm.engine
    model = engine.runner.model
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    for i in range(batch):
        engine.add_request(None, [5 + i, 6, 7, 8, 9, 10], params)
    engine.step()  # the prefill
    with count_launches({"layer": model.stack.layers[1], "model": model}) as count:
        outputs = engine.step()
    assert len(outputs) == batch and all(len(out.token_ids) == 2 for out in outputs)
    assert count.by_scope["layer"] == collections.Counter({
        "linear": 4, "triton:_rms_norm": 2, "triton:_rope_write_kv": 1,
        "triton:_paged_attention": 1, "triton:_silu_and_mul": 1})
    layers = len(model.stack.layers)
    assert count.launches() <= 9 * layers + 12  # the rest: embedding, layout, head, sampler
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_blocks


def test_a_prefill_step_runs_the_query_tiles_once_a_layer(gpu_ops_llm):
    """A step with prefill chunks (a 40-token prompt beside a decoding request): one launch
    of the attention kernel a layer, in query tiles for every row; no split to merge."""
    engine = gpu_ops_llm.engine
    model = engine.runner.model
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    engine.add_request(None, [5, 6, 7], params)
    engine.step()  # its prefill: it decodes next, beside the long prompt's prefill
    engine.add_request(None, list(range(10, 50)), params)
    with count_launches({"layer": model.stack.layers[1]}) as count:
        engine.step()
    layer = count.by_scope["layer"]
    assert layer["triton:_paged_attention"] == 1 and "triton:_merge_splits" not in layer
    assert sum(layer.values()) == 9
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_blocks

