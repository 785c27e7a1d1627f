"""RoPE scaling (Llama 3.x's "llama3", "linear") from config.json and from a GGUF's
rope_freqs tensor, against transformers on the same weights; scalings not implemented are
refused by name; Mistral's sliding window (every layer) is applied past the window, in the
torch path and in the C++ kernels, as transformers applies it."""
from __future__ import annotations

import json
import os

import pytest
import torch

from pagedllm.weights import ModelLoadError, load_checkpoint
from pagedllm.weights.rope import inverse_frequencies, llama3_factors
from test_weights import hf_logits, our_logits
from tiny_models import tiny_hf_model, write_gguf, write_hf_folder

# 120 tokens: positions far enough that a wrong frequency shows in the logits.
LONG_PROMPT = [(7 * i + 3) % 250 + 5 for i in range(120)]
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}


@pytest.mark.parametrize("scaling", [LLAMA3, {"rope_type": "linear", "factor": 4.0}],
                         ids=["llama3", "linear"])
def test_hf_rope_scaling_matches_transformers(tmp_path, scaling, at_isa):
    """At every CPU level: the scaled tables are made in Python, the kernels apply them."""
    model = tiny_hf_model("llama", seed=3, rope_scaling=scaling)
    folder = write_hf_folder(model, tmp_path)
    assert load_checkpoint(folder).config.rope_freq_factors is not None
    ours = our_logits(folder, LONG_PROMPT)
    reference = hf_logits(model, LONG_PROMPT)
    assert torch.allclose(ours, reference, atol=1e-4, rtol=0)
    # ...and the scaling matters: plain RoPE on the same weights answers otherwise.
    plain = tiny_hf_model("llama", seed=3)
    assert not torch.allclose(hf_logits(plain, LONG_PROMPT), reference, atol=1e-2)


def test_gguf_rope_freqs_tensor_is_applied(tmp_path, at_isa):
    """llama.cpp writes Llama 3's scaling as per-dimension divisors (rope_freqs)."""
    model = tiny_hf_model("llama", seed=3, rope_scaling=LLAMA3)
    factors = llama3_factors(16, 10000.0, 8.0, 1.0, 4.0, 64)
    path = write_gguf(model, tmp_path / "llama3.gguf", rope_freqs=list(factors))
    assert load_checkpoint(path).config.rope_freq_factors == pytest.approx(factors)
    assert torch.allclose(our_logits(path, LONG_PROMPT), hf_logits(model, LONG_PROMPT),
                          atol=1e-4, rtol=0)


def test_llama3_factors_by_hand():
    # Short wavelengths kept, long ones slowed by the factor, the band between blended.
    factors = llama3_factors(16, 10000.0, 8.0, 1.0, 4.0, 64)
    wavelengths = [2 * 3.141592653589793 / f for f in inverse_frequencies(16, 10000.0)]
    for wavelength, factor in zip(wavelengths, factors):
        if wavelength < 16:
            assert factor == 1.0
        elif wavelength > 64:
            assert factor == 8.0
        else:
            assert 1.0 < factor < 8.0


@pytest.mark.parametrize("scaling, message", [
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}, "'yarn' is not supported"),
    ({"rope_type": "dynamic", "factor": 2.0}, "'dynamic' is not supported"),
    ({"rope_type": "llama3", "factor": 8.0}, "needs 'original_max_position_embeddings'"),
])
def test_unsupported_rope_scaling_is_refused_with_the_file(tmp_path, scaling, message):
    folder = write_hf_folder(tiny_hf_model("llama", seed=3), tmp_path)
    config_path = os.path.join(folder, "config.json")
    with open(config_path) as f:
        raw = json.load(f)
    raw["rope_scaling"] = scaling
    with open(config_path, "w") as f:
        json.dump(raw, f)
    with pytest.raises(ModelLoadError, match=message) as refused:
        load_checkpoint(folder)
    assert "config.json" in str(refused.value)


@pytest.mark.parametrize("head_dim", [16, 64])  # 16: the plain-torch path; 64: the kernels
def test_mistral_window_is_applied_past_it(tmp_path, head_dim, at_isa):
    """A Mistral with a 32-token window, an 80-token prompt: float32 logits of every position
    equal transformers', and 16 greedy tokens are transformers'; without the window they
    would not be (the issue's report: 0 of 16)."""
    from pagedllm import LLM, SamplingParams

    model = tiny_hf_model("mistral", seed=4, sliding_window=32, head_dim=head_dim)
    folder = write_hf_folder(model, tmp_path)
    assert load_checkpoint(folder).config.sliding_window == 32
    prompt = LONG_PROMPT[:80]
    assert (our_logits(folder, prompt) - hf_logits(model, prompt)).abs().max() < 1e-4
    llm = LLM(folder, kv_cache_memory=4 << 20)
    assert llm.engine.scheduler_config.max_model_len == 512  # the whole context is served
    ours = llm.generate([prompt], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))[0]
    with torch.no_grad():
        reference = model.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False,
                                   eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    assert ours.token_ids == reference


def test_qwen2_window_is_ignored_unless_used(tmp_path):
    model = tiny_hf_model("qwen2", seed=4, sliding_window=32, use_sliding_window=False)
    assert load_checkpoint(write_hf_folder(model, tmp_path)).config.sliding_window is None
