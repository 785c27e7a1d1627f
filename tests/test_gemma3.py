"""Gemma 3 (the text model): Gemma 2's layer with (1 + w) q/k norms, five sliding layers to a
global one, the sliding layers on their own RoPE base (10k) and the global ones on theirs
(1M, linear scaling where the config asks). A tiny random model written by the tests matches
transformers past its window; greedy 32 tokens equal; the multimodal checkpoint is refused."""
from __future__ import annotations

import json
import os

import pytest

from conftest import ISA_LEVELS, isa_level
from paged_helpers import (assert_greedy_equals_transformers, reference_logits, run_paged,
                           transformers_greedy)
from pagedllm.models.build import build_model
from pagedllm.weights import ModelLoadError, load_checkpoint
from tiny_models import tiny_hf_model, write_gguf, write_hf_folder

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


def test_the_engine_gives_window_blocks_back_as_they_slide_out(gemma3):
    """The sliding layers' pool (core/kv_cache/window.py) stays flat while a sequence grows
    far past the 16-token window, the full layer's pool grows, and the tokens still equal
    transformers'; a second request finds the first's prompt cached in both pools."""
    from pagedllm import LLM, SamplingParams
    from pagedllm.core.sizing import window_request_blocks

    model, folder = gemma3
    llm = LLM(folder, kv_cache_memory=4 << 20, block_size=4, max_num_batched_tokens=8)
    engine = llm.engine
    window = engine.kv_manager.window
    assert window is not None and window.window == 16
    prompt = SEQS[0][:30]
    params = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    request = engine.add_request(None, prompt, params)
    window_used, full_used, tokens = [], [], []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens = out.token_ids
        window_used.append(window.pool.num_used_blocks)
        full_used.append(engine.kv_manager.pool.num_used_blocks)
    assert tokens == transformers_greedy(model, prompt, 60)
    # Chunks of 8 tokens and then one a step: never more than the window's blocks plus a chunk.
    assert max(window_used) <= window_request_blocks(16, 4) + 2
    assert max(full_used) >= 22  # the full layer holds all 90 tokens: 23 blocks at the end
    assert window.pool.num_used_blocks == 0  # all back once finished
    del request
    # The same prompt again: a prefix hit in both pools, and the same answer.
    again = engine.add_request(None, prompt, params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens = out.token_ids
    assert tokens == transformers_greedy(model, prompt, 60)
    assert engine.scheduler.stats.prefix_cache_hits >= 24
    del again


def test_plan_counts_the_window_and_its_serve_command_fits(gemma3):
    """`plan` sizes five window layers by their window and one by the context; the engine
    started with the serve flags it prints holds that many full-context requests."""
    from pagedllm import LLM
    from pagedllm.core import sizing
    from pagedllm.tools.plan import make_plan, serve_command

    folder = gemma3[1]
    probe = make_plan(folder, dtype="float32", context=512, parallels=[1], memory=1 << 30)
    per_layer_token = probe.kv_bytes_per_token // 6
    assert probe.kv_bytes_per_request == per_layer_token * 16 * (
        512 // 16 + 5 * sizing.window_request_blocks(16, 16))
    assert probe.kv_bytes_per_request < probe.kv_bytes_per_token * 512 / 3
    plan = make_plan(folder, dtype="float32", context=512, parallels=[1, 4],
                     memory=probe.weight_bytes + 6 * probe.kv_bytes_per_request + probe.kv_bytes_per_step)
    assert plan.max_parallel == 6
    from pagedllm.units import parse_bytes

    flags = serve_command(plan).split()
    value = {name: parse_bytes(flags[flags.index(name) + 1])  # 12 or 3MiB, as serve takes them
             for name in ("--max-num-seqs", "--max-model-len", "--kv-cache-memory")}
    engine = LLM(folder, dtype="float32", max_num_seqs=value["--max-num-seqs"],
                 max_model_len=value["--max-model-len"],
                 kv_cache_memory=value["--kv-cache-memory"]).engine
    assert engine.capacity_tokens >= 6 * 512
    assert engine.kv_manager.window.pool.num_blocks >= 6 * sizing.window_request_blocks(16, 16)


@pytest.mark.parametrize("level", ISA_LEVELS)
@pytest.mark.parametrize("scaled", [False, True])
def test_gguf_matches_transformers(tmp_path, scaled, level):
    """As llama.cpp writes Gemma 3: (1 + w) norms, no layer pattern and no local RoPE base in
    the file (llama.cpp fixes both: five sliding layers of six, base 10,000), queries scaled
    by head_dim (query_pre_attn_scalar = head_dim, as the 1B-12B models have it); the global
    layers' linear RoPE scaling (4B and up) as metadata."""
    extra = {"query_pre_attn_scalar": 32}
    if scaled:
        extra["rope_parameters"] = {
            "full_attention": {"rope_theta": 1000000.0, "rope_type": "linear", "factor": 8.0},
            "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"}}
    model = tiny_hf_model("gemma3_text", seed=11, **extra)
    checkpoint = load_checkpoint(write_gguf(model, tmp_path / "gemma3.gguf", arch="gemma3"))
    config = checkpoint.config
    assert config.architecture == "gemma3_text" and config.qk_norm
    assert config.sliding_layers == (0, 1, 2, 3, 4) and config.sliding_window == 16
    assert (config.rope_theta, config.local_rope_theta) == (1000000.0, 10000.0)
    assert (config.rope_freq_factors is not None) == scaled
    with isa_level(level):
        ours = build_model(config, checkpoint.weights)
        together = run_paged(ours, SEQS, chunk=6, block_size=4)
    for seq, logits in zip(SEQS, together):
        assert (logits - reference_logits(model, seq)).abs().max() < 1e-4


def test_the_vision_checkpoint_is_refused(gemma3, tmp_path):
    _, folder = gemma3
    raw = json.load(open(os.path.join(folder, "config.json")))
    os.makedirs(tmp_path / "vision")
    json.dump({"model_type": "gemma3", "text_config": raw}, open(tmp_path / "vision" / "config.json", "w"))
    with pytest.raises(ModelLoadError, match="vision tower"):
        load_checkpoint(str(tmp_path / "vision"))


@pytest.mark.parametrize("level", ISA_LEVELS)
def test_kernels_at_head_dim_256_through_the_window_pool(tmp_path, level):
    """Gemma 3's real head size, 256: attention in the C++ kernels, the sliding layers on
    their own pool whose blocks go back as they slide out (a 57-token prompt, a 16-token
    window, blocks of 4), greedy tokens still transformers'."""
    model = tiny_hf_model("gemma3_text", seed=13, head_dim=256)
    folder = write_hf_folder(model, tmp_path)
    with isa_level(level):
        assert_greedy_equals_transformers(model, folder, [SEQS[0]], max_tokens=16, block_size=4)
