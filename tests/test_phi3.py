"""Phi-3: q/k/v and gate/up fused in the checkpoint (HF `qkv_proj`, `gate_up_proj`; GGUF
`attn_qkv`, and an `ffn_up` that holds gate and up). Tiny random models written by the tests
match transformers through the paged, batched, chunked path; greedy 32 tokens equal; Phi-4-mini's
partial rotary embedding is refused by name."""
from __future__ import annotations

import pytest
import torch

from conftest import ISA_LEVELS, isa_level
from paged_helpers import (assert_greedy_equals_transformers, bfloat16_argmax_agreement,
                           run_paged)
from pagedllm.models.build import build_model
from pagedllm.weights import ModelLoadError, load_checkpoint
from tiny_models import tiny_hf_model, write_gguf, write_hf_folder

SEQS = [list(range(3, 60)), [7, 3, 9, 200, 15, 15, 16, 80, 81], [42]]


@pytest.fixture(scope="module")
def phi3():
    return tiny_hf_model("phi3", seed=7, tie=False)


@pytest.fixture(scope="module")
def sources(phi3, tmp_path_factory):
    return {"folder": write_hf_folder(phi3, tmp_path_factory.mktemp("phi3")),
            "gguf": write_gguf(phi3, tmp_path_factory.mktemp("phi3g") / "phi3.gguf", arch="phi3"),
            "gguf-q4": write_gguf(phi3, tmp_path_factory.mktemp("phi3q") / "phi3.gguf", "Q4_0",
                                  arch="phi3")}


def reference_logits(model, seq):
    with torch.no_grad():
        return model(torch.tensor([seq])).logits[0]


@pytest.mark.parametrize("level", ISA_LEVELS)
@pytest.mark.parametrize("source", ["folder", "gguf"])
def test_float32_logits_match_transformers(phi3, sources, source, level):
    with isa_level(level):
        checkpoint = load_checkpoint(sources[source])
        assert checkpoint.config.architecture == "phi3"
        model = build_model(checkpoint.config, checkpoint.weights)
        together = run_paged(model, SEQS, chunk=5, block_size=4)
    for seq, logits in zip(SEQS, together):
        assert (logits - reference_logits(phi3, seq)).abs().max() < 1e-4


def test_q4_gguf_keeps_the_fused_projections_4bit(phi3, sources):
    checkpoint = load_checkpoint(sources["gguf-q4"])
    assert {"layers.0.self_attn.qkv_proj.weight", "layers.0.mlp.gate_up_proj.weight"} <= set(
        checkpoint.quantized)
    model = build_model(checkpoint.config, checkpoint.weights, checkpoint.quantized,
                        dtype=torch.bfloat16)
    assert bfloat16_argmax_agreement(phi3, model, SEQS[0]) > 0.6


def test_greedy_tokens_equal_transformers(phi3, sources):
    assert_greedy_equals_transformers(phi3, sources["folder"], [SEQS[0][:20]])


def test_partial_rotary_is_refused(tmp_path):
    model = tiny_hf_model("phi3", seed=7, partial_rotary_factor=0.75)
    with pytest.raises(ModelLoadError, match="partial_rotary_factor 0.75"):
        load_checkpoint(write_hf_folder(model, tmp_path))
