"""Qwen3 (dense): per-head RMSNorm of q and k before RoPE, an explicit head_dim wider than
hidden_size / heads. A tiny random model written by the tests, as a Hugging Face folder and
as GGUF, matches transformers through the paged, batched, chunked path, and its greedy
tokens equal transformers' for 32 tokens, at every CPU level this host runs."""
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
def qwen3():
    return tiny_hf_model("qwen3", seed=5, tie=False)


@pytest.fixture(scope="module")
def qwen3_folder(qwen3, tmp_path_factory):
    return write_hf_folder(qwen3, tmp_path_factory.mktemp("qwen3"))


@pytest.fixture(scope="module")
def qwen3_gguf(qwen3, tmp_path_factory):
    return write_gguf(qwen3, tmp_path_factory.mktemp("qwen3_gguf") / "qwen3.gguf", arch="qwen3")


@pytest.mark.parametrize("source", ["folder", "gguf"])
def test_config_has_the_norms_and_the_explicit_head_dim(source, qwen3_folder, qwen3_gguf):
    config = load_checkpoint(qwen3_folder if source == "folder" else qwen3_gguf).config
    assert config.architecture == "qwen3" and config.qk_norm
    assert config.head_dim == 64 and config.hidden_size // config.num_heads == 16
    assert config.sliding_window is None  # Qwen3 declares one but does not use it


@pytest.mark.parametrize("level", ISA_LEVELS)
@pytest.mark.parametrize("source", ["folder", "gguf"])
def test_float32_logits_match_transformers_batched_and_chunked(source, level, qwen3, qwen3_folder,
                                                               qwen3_gguf):
    with isa_level(level):
        checkpoint = load_checkpoint(qwen3_folder if source == "folder" else qwen3_gguf)
        model = build_model(checkpoint.config, checkpoint.weights)
        together = run_paged(model, SEQS, chunk=5, block_size=4)
    for seq, logits in zip(SEQS, together):
        assert (logits - reference_logits(qwen3, seq)).abs().max() < 1e-4


def test_greedy_tokens_equal_transformers(qwen3, qwen3_folder):
    assert_greedy_equals_transformers(qwen3, qwen3_folder, [SEQS[0][:20], SEQS[1]])


def test_bfloat16_runs_without_the_fused_decode_loop(qwen3, qwen3_gguf):
    checkpoint = load_checkpoint(qwen3_gguf)
    model = build_model(checkpoint.config, checkpoint.weights, dtype=torch.bfloat16)
    assert model.decode_loop is None  # the C++ loop has no per-head norm: the layers run it
    assert bfloat16_argmax_agreement(qwen3, model, SEQS[0]) > 0.8
