"""A GGUF's quantized matrices run on their codes in the bfloat16 model, never as a float
copy: a file laid out as llama.cpp's Q4_K_M lays one out (Q4_K for most matrices and the
embedding, Q6_K for attn_v and ffn_down) gets 4-bit modules for the Q4_K parts in Q4_K's own
two-level layout, 6-bit ones for the Q6_K parts, a stacked q/k/v where they differ, 8-bit
embedding rows and head; its float32 build still equals transformers on the same file."""
from __future__ import annotations

import pytest
import torch

from conftest import ISA_LEVELS, isa_level
from paged_helpers import run_paged
from pagedllm.models.build import build_model
from pagedllm.models.output_head import Q8Head
from pagedllm.models.quant_linear import Q6Linear, QuantLinear, StackedLinear
from pagedllm.weights import load_checkpoint
from test_weights import hf_logits
from tiny_models import write_gguf

Q4_K_M = {"attn_v.weight": "Q6_K", "ffn_down.weight": "Q6_K"}  # the rest Q4_K
Q4K_BLOCK_BYTES = 8 * 256 + 2 * 8 * 16 + 2 * 2 * 16  # codes, scales and mins, d and dmin
PROMPT = [(5 * i + 2) % 250 + 3 for i in range(40)]


def tiny_model(seed: int, layers: int = 2):
    """A random Llama whose matrices k-quants can hold: rows of 256-value blocks, a
    vocabulary of whole 16-row tiles."""
    from transformers import LlamaConfig, LlamaForCausalLM as HFLlama

    torch.manual_seed(seed)
    return HFLlama(LlamaConfig(vocab_size=272, hidden_size=256, intermediate_size=512,
                               num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                               max_position_embeddings=512, tie_word_embeddings=True)).eval()


@pytest.fixture(scope="module")
def q4_k_m(tmp_path_factory):
    folder = tmp_path_factory.mktemp("q4_k_m")
    return folder, write_gguf(tiny_model(5), folder / "m.gguf", "Q4_K", qtypes=Q4_K_M)


def test_float32_build_matches_transformers_on_the_mixed_file(q4_k_m):
    from transformers import AutoModelForCausalLM

    folder, path = q4_k_m
    reference = AutoModelForCausalLM.from_pretrained(folder, gguf_file="m.gguf", dtype=torch.float32)
    checkpoint = load_checkpoint(path)
    ours = run_paged(build_model(checkpoint.config, checkpoint.weights), [PROMPT])[0]
    theirs = hf_logits(reference, PROMPT)
    assert torch.allclose(ours, theirs, atol=1e-6 * theirs.abs().max().item(), rtol=1e-4)


@pytest.mark.parametrize("level", ISA_LEVELS)
def test_bfloat16_model_runs_on_the_codes(q4_k_m, level):
    _, path = q4_k_m
    with isa_level(level):
        checkpoint = load_checkpoint(path)
        # Nothing quantized was read as floats by the loader.
        assert not any("_proj" in name or "embed" in name for name in checkpoint.weights.dense)
        model = build_model(checkpoint.config, checkpoint.weights, checkpoint.quantized,
                            dtype=torch.bfloat16)
        for layer in model.layers:
            qkv = layer.self_attn.qkv_proj
            assert isinstance(qkv, StackedLinear)  # q, k 4-bit (fused), v 6-bit
            assert [type(p) for p in qkv.parts] == [QuantLinear, Q6Linear]
            assert isinstance(layer.self_attn.o_proj, QuantLinear)
            assert isinstance(layer.mlp.gate_up_proj, QuantLinear)
            assert isinstance(layer.mlp.down_proj, Q6Linear)
            # Q4_K in its own layout: 8 groups of 32 under one d and dmin (q4k_pack's block).
            for q4 in (qkv.parts[0], layer.self_attn.o_proj, layer.mlp.gate_up_proj):
                assert q4.packed.shape[-1] == Q4K_BLOCK_BYTES
        assert model.embedding.q8 is not None and model.embedding.weight is None
        assert isinstance(model.head, Q8Head)
        # No float copy of any matrix: the parameters left are the norms.
        assert all(p.dim() == 1 for p in model.parameters())
        low_bit = run_paged(model, [PROMPT])[0]
        exact = run_paged(build_model(checkpoint.config, checkpoint.weights), [PROMPT])[0]
    # int8-rounded activations and bfloat16: close, not equal.
    similarity = torch.nn.functional.cosine_similarity(low_bit, exact, dim=-1)
    assert similarity.min() > 0.99, similarity.min()
    assert (low_bit.argmax(-1) == exact.argmax(-1)).float().mean() > 0.8


def test_a_projection_with_a_float_part_stacks_it_densely(q4_k_m, tmp_path):
    """attn_v stored as F32 next to 4-bit q and k: the stack's dense part is bfloat16."""
    path = write_gguf(tiny_model(6, layers=1), tmp_path / "f.gguf", "Q4_K", qtypes={"attn_v.weight": "F32"})
    checkpoint = load_checkpoint(path)
    net = build_model(checkpoint.config, checkpoint.weights, checkpoint.quantized, dtype=torch.bfloat16)
    qkv = net.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, StackedLinear) and isinstance(qkv.parts[0], QuantLinear)
    assert qkv.parts[1].weight.dtype in (torch.bfloat16, torch.float32)  # DenseLinear's own form
    x = torch.randn(3, 256).bfloat16()
    v = checkpoint.weights["layers.0.self_attn.v_proj.weight"]
    assert torch.allclose(qkv(x)[:, -v.shape[0]:].float(), x.float() @ v.T, atol=5e-2, rtol=5e-2)


@pytest.fixture(scope="module")
def q8_0(tmp_path_factory):
    """The same model with every matrix Q8_0."""
    return write_gguf(tiny_model(5), tmp_path_factory.mktemp("q8_0") / "m.gguf", "Q8_0")


@pytest.mark.parametrize("level", ISA_LEVELS)
@pytest.mark.parametrize("kind", ["q4_k_m", "q8_0"])
def test_low_bit_formats_take_the_cpp_decode_loop(q4_k_m, q8_0, kind, level, monkeypatch):
    """Projections in parts of different formats (q, k Q4_K next to a Q6_K v), or all Q8_0,
    run in the C++ decode loop too, bit-identical to the Python layers."""
    from pagedllm.models.decode_loop import DecodeLoop

    path = q4_k_m[1] if kind == "q4_k_m" else q8_0
    with isa_level(level):
        checkpoint = load_checkpoint(path)
        model = build_model(checkpoint.config, checkpoint.weights, checkpoint.quantized,
                            dtype=torch.bfloat16)
        loop = model.decode_loop
        assert loop is not None
        qkv_parts = 2 if kind == "q4_k_m" else 1  # qkv in two parts where its formats differ
        assert [len(parts) for parts in loop.weights[:6]] == [1, qkv_parts, 1, 1, 1, 1]
        calls = []
        original = DecodeLoop.__call__
        monkeypatch.setattr(DecodeLoop, "__call__", lambda self, *a: calls.append(1) or original(self, *a))
        seqs = [PROMPT[:9], PROMPT[5:30], PROMPT[:3]]
        fast = run_paged(model, seqs, block_size=16, chunk=1)
        assert calls
        model.decode_loop = None
        slow = run_paged(model, seqs, block_size=16, chunk=1)
    for f, s in zip(fast, slow):
        assert torch.equal(f, s)
