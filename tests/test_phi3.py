"""Phi-3: q/k/v and gate/up fused in the checkpoint (HF `qkv_proj`, `gate_up_proj`; GGUF
`attn_qkv`, and an `ffn_up` that holds gate and up). Tiny random models written by the tests
match transformers through the paged, batched, chunked path; greedy 32 tokens equal. Phi-3.5's
LongRoPE (short factors within the original context, long ones past it, cos/sin scaled) and
Phi-4-mini's partial rotary embedding (3/4 of each head) as well, from folders and GGUF."""
from __future__ import annotations

import pytest
import torch

from conftest import ISA_LEVELS, isa_level
from paged_helpers import (assert_greedy_equals_transformers, bfloat16_argmax_agreement,
                           run_paged, reference_logits)
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


# -- Phi-3.5 / Phi-4-mini: LongRoPE with an original context of 64, partial rotary 0.75 --------

ORIGINAL = 64
SHORT = [1.0, 1.1, 1.3, 1.6, 2.0, 2.5]  # one divisor per rotated frequency: 12 of 16 dims
LONG = [2.0, 3.0, 4.5, 6.0, 8.0, 12.0]


@pytest.fixture(scope="module")
def phi4mini():
    return tiny_hf_model("phi3", seed=8, tie=False, partial_rotary_factor=0.75,
                         original_max_position_embeddings=ORIGINAL,
                         rope_scaling={"rope_type": "longrope", "short_factor": SHORT,
                                       "long_factor": LONG})


@pytest.fixture(scope="module")
def phi4mini_sources(phi4mini, tmp_path_factory):
    return {"folder": write_hf_folder(phi4mini, tmp_path_factory.mktemp("phi4")),
            "gguf": write_gguf(phi4mini, tmp_path_factory.mktemp("phi4g") / "phi4.gguf",
                               arch="phi3")}


@pytest.mark.parametrize("source", ["folder", "gguf"])
def test_longrope_and_partial_rotary_reach_the_config(phi4mini_sources, source):
    config = load_checkpoint(phi4mini_sources[source]).config
    assert config.rotary_dim == 12 and config.head_dim == 16
    assert config.rope_freq_factors == pytest.approx(SHORT)
    assert config.rope_long_freq_factors == pytest.approx(LONG)
    assert config.rope_original_context == ORIGINAL
    # sqrt(1 + ln(512 / 64) / ln(64)): the context is extended 8x
    assert config.rope_attention_factor == pytest.approx(1.5 ** 0.5)


@pytest.mark.parametrize("level", ISA_LEVELS)
@pytest.mark.parametrize("source", ["folder", "gguf"])
def test_float32_logits_match_transformers_within_the_original_context(
        phi4mini, phi4mini_sources, source, level):
    with isa_level(level):
        checkpoint = load_checkpoint(phi4mini_sources[source])
        model = build_model(checkpoint.config, checkpoint.weights)
        together = run_paged(model, SEQS, chunk=5, block_size=4)
    for seq, logits in zip(SEQS, together):
        assert (logits - reference_logits(phi4mini, seq)).abs().max() < 1e-4


def test_past_the_original_context_the_long_factors_match_transformers(phi4mini, phi4mini_sources):
    """A served context past the original one rotates every position with the long factors,
    as transformers does for a sequence longer than the original context."""
    checkpoint = load_checkpoint(phi4mini_sources["folder"])
    model = build_model(checkpoint.config, checkpoint.weights)
    assert model.serve_context(512)
    seq = [(7 * i) % 250 + 3 for i in range(100)]
    (logits,) = run_paged(model, [seq], chunk=32, block_size=4)
    assert (logits - reference_logits(phi4mini, seq)).abs().max() < 1e-4
    short = build_model(checkpoint.config, checkpoint.weights)
    assert not short.serve_context(ORIGINAL)  # within it: the short factors stay
    (moved,) = run_paged(short, [seq], chunk=32, block_size=4)
    assert (moved - logits).abs().max() > 1e-2  # the test above can tell them apart


def test_partial_rotary_tables_leave_the_passing_dimensions_alone():
    from pagedllm.models.build import rotary_permutation
    from pagedllm.models.llama import RotaryEmbedding

    rotary = RotaryEmbedding(16, 8, 10000.0, rotary_dim=12, attention_factor=2.0)
    passing = [6, 7, 14, 15]  # the ends of each half, after rotary_permutation
    assert torch.equal(rotary.cos[:, passing], torch.ones(8, 4))
    assert torch.equal(rotary.sin[:, passing], torch.zeros(8, 4))
    assert rotary.cos[0, 0] == 2.0  # the rotated part is scaled
    order = rotary_permutation(16, 12).tolist()
    assert sorted(order) == list(range(16))
    assert [order[d] for d in passing] == [12, 13, 14, 15]
    assert [order[d + 8] - order[d] for d in range(6)] == [6] * 6  # rotate-half pairs


def test_greedy_tokens_equal_transformers_with_longrope(phi4mini, phi4mini_sources):
    assert_greedy_equals_transformers(phi4mini, phi4mini_sources["folder"], [SEQS[0][:20]],
                                      max_model_len=ORIGINAL)


def test_a_longrope_gguf_missing_its_long_table_is_refused(phi4mini, tmp_path):
    path = write_gguf(phi4mini, tmp_path / "phi4.gguf", arch="phi3",
                      omit=("rope_factors_long.weight",))
    with pytest.raises(ModelLoadError, match="rope_factors_long"):
        load_checkpoint(path)
