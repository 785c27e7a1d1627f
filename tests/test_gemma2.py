"""Gemma 2: embeddings times sqrt(hidden), (1 + w) norms around attention and MLP, GeGLU,
attention scaled by query_pre_attn_scalar and soft-capped, final logits soft-capped, and a
sliding window on every other layer. A tiny random model written by the tests matches
transformers over prompts longer than its 16-token window, through the paged, batched,
chunked path, from a Hugging Face folder and from GGUF (llama.cpp's names, (1 + w) stored);
greedy 32 tokens equal transformers'."""
from __future__ import annotations

import pytest
import torch

from conftest import ISA_LEVELS, isa_level
from paged_helpers import (assert_greedy_equals_transformers, bfloat16_argmax_agreement,
                           run_paged, reference_logits)
from pagedllm.models.build import build_model
from pagedllm.weights import load_checkpoint
from tiny_models import tiny_hf_model, write_gguf, write_hf_folder

SEQS = [list(range(3, 60)), [7, 3, 9, 200, 15, 15, 16, 80, 81], [42], list(range(100, 140))]


@pytest.fixture(scope="module")
def gemma2():
    return tiny_hf_model("gemma2", seed=8)


@pytest.fixture(scope="module")
def folder(gemma2, tmp_path_factory):
    return write_hf_folder(gemma2, tmp_path_factory.mktemp("gemma2"))


def test_config(folder):
    config = load_checkpoint(folder).config
    assert config.sandwich_norms and config.embedding_scale and config.hidden_act == "gelu_tanh"
    assert (config.attn_softcap, config.final_softcap) == (50.0, 30.0)
    assert config.sliding_window == 16 and config.sliding_layers == (0,)
    assert config.max_position_embeddings == 512


@pytest.mark.parametrize("level", ISA_LEVELS)
@pytest.mark.parametrize("chunk,block_size", [(None, 4), (5, 4), (1, 16)])
def test_float32_logits_match_transformers_past_the_window(gemma2, folder, chunk, block_size,
                                                           level):
    with isa_level(level):  # the layer ops (norms, RoPE) run the kernels of each level
        checkpoint = load_checkpoint(folder)
        model = build_model(checkpoint.config, checkpoint.weights)
        together = run_paged(model, SEQS, chunk=chunk, block_size=block_size)
    for seq, logits in zip(SEQS, together):
        assert (logits - reference_logits(gemma2, seq)).abs().max() < 1e-4, len(seq)


def test_the_window_and_the_caps_matter(gemma2, folder):
    """Guards the test above: without the window or the caps the logits move."""
    import dataclasses

    checkpoint = load_checkpoint(folder)
    reference = reference_logits(gemma2, SEQS[0])
    for change in ({"sliding_layers": ()}, {"attn_softcap": None, "final_softcap": None}):
        config = dataclasses.replace(checkpoint.config, **change)
        if "sliding_layers" in change:  # every layer global
            config = dataclasses.replace(config, sliding_window=None)
        logits = run_paged(build_model(config, checkpoint.weights), [SEQS[0]])[0]
        assert (logits - reference).abs().max() > 1e-3, change


def test_greedy_tokens_equal_transformers(gemma2, folder):
    assert_greedy_equals_transformers(gemma2, folder, [SEQS[0][:30]])


def test_bfloat16_runs(gemma2, folder):
    checkpoint = load_checkpoint(folder)
    model = build_model(checkpoint.config, checkpoint.weights, dtype=torch.bfloat16)
    assert model.decode_loop is None
    assert bfloat16_argmax_agreement(gemma2, model, SEQS[0]) > 0.8


def test_gguf_matches_transformers(tmp_path):
    """llama.cpp scales queries by head_dim (query_pre_attn_scalar = head_dim, as Gemma 2's
    2B and 9B have it), so the tiny model here says the same."""
    model = tiny_hf_model("gemma2", seed=9, query_pre_attn_scalar=32)
    path = write_gguf(model, tmp_path / "gemma2.gguf", arch="gemma2")
    checkpoint = load_checkpoint(path)
    assert checkpoint.config.architecture == "gemma2"
    assert checkpoint.config.sliding_layers == (0,) and checkpoint.config.sliding_window == 16
    ours = build_model(checkpoint.config, checkpoint.weights)
    for seq, logits in zip(SEQS, run_paged(ours, SEQS, chunk=6, block_size=4)):
        assert (logits - reference_logits(model, seq)).abs().max() < 1e-4


@pytest.mark.parametrize("level", ISA_LEVELS)
def test_kernels_apply_the_caps_scale_and_window(tmp_path, level):
    """head_dim 64: attention runs in the C++ kernels (the tests above, head_dim 32, take the
    plain-torch path), soft-capped, scaled by query_pre_attn_scalar, windowed every other
    layer: float32 logits still equal transformers' past the window, in chunks and whole."""
    model = tiny_hf_model("gemma2", seed=12, head_dim=64, query_pre_attn_scalar=48)
    folder = write_hf_folder(model, tmp_path)
    with isa_level(level):
        checkpoint = load_checkpoint(folder)
        net = build_model(checkpoint.config, checkpoint.weights)
        assert all(layer.self_attn.backend.kernel is not None for layer in net.layers)
        for chunk in (None, 7):
            for seq, logits in zip(SEQS, run_paged(net, SEQS, chunk=chunk)):
                assert (logits - reference_logits(model, seq)).abs().max() < 1e-4, (chunk, len(seq))
