"""A mixture of experts' small steps on the GPU's path (models/moe_triton.py, moe.py): each
(token, chosen expert) pair's product read from the stacked expert weights by a device-side
index, under Triton's interpreter here (on a GPU compiled: PAGEDLLM_TEST_DEVICE=cuda). The
kernel against a per-pair product; the MoE layer's device path against its grouped path;
and the engine: CUDA-graph decode steps for the batches whose pairs fit, greedy output as
without graphs, larger batches eager."""
from __future__ import annotations

from gpu_path import DEVICE, ON, build_engines_as_on_the_gpu, skip_without_the_gpu

import pytest  # noqa: E402
import torch  # noqa: E402

from pagedllm import LLM, SamplingParams  # noqa: E402
from pagedllm.backends.torch_layer_ops import TorchLayerOps  # noqa: E402
from pagedllm.backends.triton_layer_ops import TritonLayerOps  # noqa: E402
from pagedllm.config import ModelConfig  # noqa: E402
from pagedllm.models.moe import MoE  # noqa: E402
from pagedllm.models.moe_triton import expert_gemv  # noqa: E402
from tiny_models import tiny_hf_model, write_hf_folder  # noqa: E402

skip_without_the_gpu()


def rand(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype).to(ON)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("out_features,depth", [(64, 64), (100, 130), (16, 200)])
def test_each_pair_is_its_experts_product(dtype, out_features, depth):
    experts, top_k, tokens = 5, 2, 3
    weights = rand(experts, out_features, depth, dtype=dtype, seed=1)
    x = rand(tokens, depth, dtype=dtype, seed=2)
    chosen = torch.tensor([4, 0, 2, 2, 1, 4], device=ON)  # token t's at 2t, 2t + 1
    got = expert_gemv(x, weights, chosen, top_k)
    want = torch.stack([weights[e].float() @ x[p // top_k].float()
                        for p, e in enumerate(chosen.tolist())])
    assert got.shape == (6, out_features) and got.dtype == dtype
    tolerance = 1e-4 if dtype == torch.float32 else 3e-2
    assert (got.float() - want).abs().max() <= tolerance * want.abs().max()
    one_each = expert_gemv(got, rand(experts, 8, out_features, dtype=dtype), chosen, 1)
    assert one_each.shape == (6, 8)  # a row a pair
    assert expert_gemv(x, weights, chosen[:0], top_k).shape == (0, out_features)


def test_rows_must_be_contiguous():
    weights = rand(2, 16, 32)
    with pytest.raises(ValueError, match="contiguous"):
        expert_gemv(rand(32, 3).T, weights, torch.tensor([0, 1, 1], device=ON), 1)


def moe_layer(ops, seed=0, experts=6, top_k=2, renormalize=True):
    config = ModelConfig(architecture="mixtral", vocab_size=10, hidden_size=64,
                         intermediate_size=96, num_layers=1, num_heads=4, num_kv_heads=2,
                         head_dim=16, rms_norm_eps=1e-5, rope_theta=1e4,
                         max_position_embeddings=64, tie_word_embeddings=False,
                         num_experts=experts, num_experts_per_tok=top_k,
                         expert_intermediate_size=48, norm_topk_prob=renormalize)
    layer = MoE(config, ops)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in layer.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.2)
    return layer.to(ON)


@pytest.mark.parametrize("renormalize", [True, False])
def test_small_steps_run_their_pairs_on_the_device_as_the_grouped_path_would(renormalize,
                                                                            monkeypatch):
    device, grouped = moe_layer(TritonLayerOps, renormalize=renormalize), \
        moe_layer(TorchLayerOps, renormalize=renormalize)
    assert device.max_device_tokens() == 3 and grouped.max_device_tokens() == 0  # 6 // 2
    calls = []
    original = MoE._pairs_on_device
    monkeypatch.setattr(MoE, "_pairs_on_device",
                        lambda self, *a: calls.append(a[0].shape[0]) or original(self, *a))
    for tokens in (1, 3, 4, 9):
        x = rand(tokens, 64, seed=tokens)
        with torch.no_grad():
            got, want = device(x), grouped(x)
        assert (got - want).abs().max() < 1e-5, tokens
    assert calls == [1, 3]  # 4 and 9 tokens: more pairs than experts, the grouped path


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_a_mixture_of_experts_decodes_small_batches_through_graph_buffers(arch, tmp_path,
                                                                          monkeypatch):
    """Graph sizes up to the experts over k (tiny Mixtral: 4 // 2; Qwen3-MoE: 6 // 2), greedy
    output equal to the eager path's, a batch above them eager, every block back."""
    from pagedllm.engine import cuda_graphs

    build_engines_as_on_the_gpu(monkeypatch, layer_ops="triton")
    folder = write_hf_folder(tiny_hf_model(arch, seed=2), tmp_path)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = [[5, 6, 7, 8, 9], [11, 12], [40, 41, 42, 43, 44, 45, 46]]
    kwargs = dict(dtype="float32", kv_cache_memory=8 << 20, device=DEVICE, max_num_seqs=4)
    want = [o.token_ids for o in LLM(folder, cuda_graphs=False, **kwargs).generate(
        prompts, params)]
    sizes = []
    run = cuda_graphs.DecodeGraphs.run
    monkeypatch.setattr(cuda_graphs.DecodeGraphs, "run",
                        lambda self, rows, *pending: sizes.append(len(rows))
                        or run(self, rows, *pending))
    # (a short context: tables of 9 blocks, read unsplit; tests/test_generic_backend.py)
    graphed = LLM(folder, cuda_graphs=True, max_model_len=128, **kwargs)
    assert graphed.engine.runner.model.max_graph_batch == {"mixtral": 2, "qwen3_moe": 3}[arch]
    assert graphed.engine.runner.graphs.sizes == (1, 2)
    assert [o.token_ids for o in graphed.generate(prompts, params)] == want
    assert not sizes  # 3 at once: eager
    assert [o.token_ids for o in graphed.generate(prompts[:2], params)] == want[:2]
    assert [o.token_ids for o in graphed.generate(prompts[2:], params)] == want[2:]
    assert set(sizes) == {1, 2}
    manager = graphed.engine.kv_manager
    assert manager.num_free_blocks == manager.num_blocks
