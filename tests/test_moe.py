"""Mixtures of experts (Mixtral, Qwen3-MoE) from Hugging Face folders and GGUF (llama.cpp's
stacked expert tensors; a Mixtral GGUF says "llama"): tiny random models
written by the tests match transformers through the paged, batched, chunked path, greedy
tokens equal transformers' for 32 tokens, and a step's tokens are grouped by expert with
the same result as routing each token alone."""
from __future__ import annotations

import pytest
import torch

from conftest import ISA_LEVELS, isa_level
from paged_helpers import (assert_greedy_equals_transformers, bfloat16_argmax_agreement,
                           run_paged, reference_logits)
from pagedllm.models.build import build_model
from pagedllm.weights import ModelLoadError, load_checkpoint
from tiny_models import tiny_hf_model, write_gguf, write_hf_folder

SEQS = [list(range(3, 60)), [7, 3, 9, 200, 15, 15, 16, 80, 81], [42], list(range(100, 140))]
# Qwen3-MoE's norm_topk_prob (renormalize the chosen experts' weights) is off by default
# and on in Qwen3-30B-A3B's config: both are covered; Mixtral always renormalizes.
VARIANTS = {"mixtral": {}, "qwen3_moe": {"norm_topk_prob": True},
            "qwen3_moe-plain": {"norm_topk_prob": False}}


@pytest.fixture(scope="module", params=list(VARIANTS))
def moe(request, tmp_path_factory):
    arch = request.param.split("-")[0]
    model = tiny_hf_model(arch, seed=6, tie=False, **VARIANTS[request.param])
    folder = write_hf_folder(model, tmp_path_factory.mktemp(arch))
    assert load_checkpoint(folder).config.norm_topk_prob == (request.param != "qwen3_moe-plain")
    return arch, model, folder


def test_config_reads_the_experts(moe):
    arch, model, folder = moe
    config = load_checkpoint(folder).config
    assert config.architecture == arch
    assert (config.num_experts, config.num_experts_per_tok) == ((4, 2) if arch == "mixtral" else (6, 2))
    assert config.expert_intermediate_size == (128 if arch == "mixtral" else 32)
    assert config.qk_norm == (arch == "qwen3_moe")


@pytest.mark.parametrize("level", ISA_LEVELS)
def test_float32_logits_match_transformers_batched_and_chunked(moe, level):
    _, model, folder = moe
    with isa_level(level):
        checkpoint = load_checkpoint(folder)
        ours = build_model(checkpoint.config, checkpoint.weights)
        together = run_paged(ours, SEQS, chunk=6, block_size=4)
    for seq, logits in zip(SEQS, together):
        assert (logits - reference_logits(model, seq)).abs().max() < 1e-4


def test_greedy_tokens_equal_transformers(moe):
    _, model, folder = moe
    assert_greedy_equals_transformers(model, folder, [SEQS[0][:20], SEQS[1]])


def test_grouping_by_expert_equals_routing_each_token_alone(moe):
    _, _, folder = moe
    checkpoint = load_checkpoint(folder)
    layer = build_model(checkpoint.config, checkpoint.weights).layers[0].mlp
    x = torch.randn(37, checkpoint.config.hidden_size)
    weights, experts = layer.route(x)
    assert experts.unique().numel() > 1  # the tokens really spread over several experts
    alone = torch.stack([
        sum(w * (layer.ops.silu_and_mul(x[t:t + 1] @ layer.experts_gate_up[e].T)
                 @ layer.experts_down[e].T)[0]
            for w, e in zip(weights[t], experts[t].tolist()))
        for t in range(x.shape[0])])
    assert torch.allclose(layer(x), alone, atol=1e-5)


def test_bfloat16_runs_the_experts(moe):
    _, model, folder = moe
    checkpoint = load_checkpoint(folder)
    ours = build_model(checkpoint.config, checkpoint.weights, dtype=torch.bfloat16)
    assert ours.decode_loop is None
    assert bfloat16_argmax_agreement(model, ours, SEQS[0]) > 0.8


def test_qwen3_moe_with_dense_layers_between_is_refused(tmp_path):
    model = tiny_hf_model("qwen3_moe", seed=6, mlp_only_layers=[1])
    folder = write_hf_folder(model, tmp_path)
    with pytest.raises(ModelLoadError, match="mlp_only_layers"):
        load_checkpoint(folder)


@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
def test_gguf_matches_transformers(moe, qtype, tmp_path):
    """The same weights through the gguf package's writer, as llama.cpp lays them out."""
    arch, model, _ = moe
    if arch == "qwen3_moe" and not model.config.norm_topk_prob:
        pytest.skip("llama.cpp always renormalizes Qwen3-MoE's chosen experts")
    path = write_gguf(model, tmp_path / "moe.gguf", qtype,
                      arch={"mixtral": "llama", "qwen3_moe": "qwen3moe"}[arch])
    checkpoint = load_checkpoint(path)
    config = checkpoint.config
    assert (config.architecture, config.num_experts, config.num_experts_per_tok) == (
        ("llama", 4, 2) if arch == "mixtral" else ("qwen3_moe", 6, 2))
    ours = build_model(checkpoint.config, checkpoint.weights)
    together = run_paged(ours, SEQS[:2], chunk=5, block_size=4)
    tolerance = 1e-4 if qtype == "F32" else 0.5  # Q8_0 rounds the weights themselves
    for seq, logits in zip(SEQS[:2], together):
        reference = reference_logits(model, seq)
        assert (logits - reference).abs().max() < tolerance
        assert (logits.argmax(-1) == reference.argmax(-1)).float().mean() > 0.9


@pytest.mark.parametrize("level", ISA_LEVELS)
@pytest.mark.parametrize("qtype", ["Q4_0", "Q8_0"])
def test_gguf_experts_run_on_their_codes(moe, qtype, level, tmp_path):
    """A quantized GGUF's stacked experts become one low-bit module per expert (4-bit for
    Q4_0, 8-bit for Q8_0) in the bfloat16 model, with no float copy of them; its logits stay
    with the float32 build of the same file."""
    from pagedllm.models.quant_linear import Q8Linear, QuantLinear

    arch, model, _ = moe
    if arch == "qwen3_moe" and not model.config.norm_topk_prob:
        pytest.skip("llama.cpp always renormalizes Qwen3-MoE's chosen experts")
    path = write_gguf(model, tmp_path / "moe.gguf", qtype,
                      arch={"mixtral": "llama", "qwen3_moe": "qwen3moe"}[arch])
    with isa_level(level):
        checkpoint = load_checkpoint(path)
        low_bit = build_model(checkpoint.config, checkpoint.weights, checkpoint.quantized,
                              dtype=torch.bfloat16)
        kind = QuantLinear if qtype == "Q4_0" else Q8Linear
        for layer in low_bit.layers:
            experts = layer.mlp.expert_modules
            assert len(experts) == checkpoint.config.num_experts
            assert all(isinstance(m, kind) for pair in experts for m in pair)
            assert not hasattr(layer.mlp, "experts_down")  # the stacked floats are gone
        ours = run_paged(low_bit, SEQS[:2], chunk=5, block_size=4)
        exact = run_paged(build_model(checkpoint.config, checkpoint.weights), SEQS[:2], chunk=5,
                          block_size=4)
    for a, b in zip(ours, exact):
        assert torch.nn.functional.cosine_similarity(a, b, dim=-1).min() > 0.99
    # Over the 57-token sequence (the 9-token one is too short for a rate: a near tie flips).
    agreement = (ours[0].argmax(-1) == exact[0].argmax(-1)).float().mean()
    assert agreement > 0.8


@pytest.mark.parametrize("level", ISA_LEVELS)
def test_bfloat16_dense_experts_are_prepacked_where_the_level_has_bf16(moe, level):
    """avx512: one prepacked module per expert; below it the stacked parameters stay (a
    widened float32 copy would double them). Both answer alike."""
    _, model, folder = moe
    with isa_level(level):
        checkpoint = load_checkpoint(folder)
        ours = build_model(checkpoint.config, checkpoint.weights, dtype=torch.bfloat16)
        experts = ours.layers[0].mlp.expert_modules
        assert (experts is not None) == (level == "avx512")
        if experts is not None:
            assert all(module.prepacked for pair in experts for module in pair)
        assert bfloat16_argmax_agreement(model, ours, SEQS[0]) > 0.8
