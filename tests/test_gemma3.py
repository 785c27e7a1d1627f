"""Gemma 3 (the text model): Gemma 2's layer with (1 + w) q/k norms, five sliding layers to a
global one, the sliding layers on their own RoPE base (10k) and the global ones on theirs
(1M, linear scaling where the config asks). A tiny random model written by the tests matches
transformers past its window; greedy 32 tokens equal; the multimodal checkpoint is refused."""
from __future__ import annotations

import json
import os

import pytest
import torch

from conftest import ISA_LEVELS, isa_level
from paged_helpers import assert_greedy_equals_transformers, run_paged
from pagedllm.models.build import build_model
from pagedllm.weights import ModelLoadError, load_checkpoint
from tiny_models import tiny_hf_model, write_hf_folder

SEQS = [list(range(3, 60)), [7, 3, 9, 200, 15, 15, 16, 80, 81], [42]]


@pytest.fixture(scope="module", params=["plain", "scaled"])
def gemma3(request, tmp_path_factory):
    extra = {}
    if request.param == "scaled":  # as Gemma 3 4B+: the global layers' RoPE scaled by 8
        extra = {"rope_parameters": {
            "full_attention": {"rope_theta": 1000000.0, "rope_type": "linear", "factor": 8.0},
            "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"}}}
    model = tiny_hf_model("gemma3_text", seed=10, **extra)
    return model, write_hf_folder(model, tmp_path_factory.mktemp("gemma3"))


def reference_logits(model, seq):
    with torch.no_grad():
        return model(torch.tensor([seq])).logits[0]


def test_config(gemma3):
    config = load_checkpoint(gemma3[1]).config
    assert config.qk_norm and config.sandwich_norms and config.sliding_layers == (0, 1, 2, 3, 4)
    assert (config.rope_theta, config.local_rope_theta) == (1000000.0, 10000.0)
    assert config.attn_softcap is None and config.final_softcap is None


@pytest.mark.parametrize("level", ISA_LEVELS)
@pytest.mark.parametrize("chunk", [None, 5])
def test_float32_logits_match_transformers_past_the_window(gemma3, chunk, level):
    model, folder = gemma3
    with isa_level(level):
        checkpoint = load_checkpoint(folder)
        ours = build_model(checkpoint.config, checkpoint.weights)
        together = run_paged(ours, SEQS, chunk=chunk, block_size=4)
    for seq, logits in zip(SEQS, together):
        assert (logits - reference_logits(model, seq)).abs().max() < 1e-4, len(seq)


def test_greedy_tokens_equal_transformers(gemma3):
    model, folder = gemma3
    assert_greedy_equals_transformers(model, folder, [SEQS[0][:30]])


def test_the_vision_checkpoint_is_refused(gemma3, tmp_path):
    _, folder = gemma3
    raw = json.load(open(os.path.join(folder, "config.json")))
    os.makedirs(tmp_path / "vision")
    json.dump({"model_type": "gemma3", "text_config": raw}, open(tmp_path / "vision" / "config.json", "w"))
    with pytest.raises(ModelLoadError, match="vision tower"):
        load_checkpoint(str(tmp_path / "vision"))
