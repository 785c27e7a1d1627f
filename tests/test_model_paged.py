"""The model over the paged KV cache: batching, chunking and scattered blocks change nothing."""
import pytest
import torch

from pagedllm.models.build import build_model
from pagedllm.weights import load_checkpoint
from paged_helpers import run_paged

SEQS = [
    [7, 3, 9, 200, 15, 15, 16, 80, 81, 82, 83, 84, 85, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20],
    [1, 2, 3],
    [250, 249, 248, 247, 246, 245, 244, 243, 242, 241, 240],
    [42],
    list(range(100, 137)),
]


@pytest.fixture(scope="module")
def tiny_model(tiny_llama_folder):
    checkpoint = load_checkpoint(tiny_llama_folder)
    model = build_model(checkpoint.config, checkpoint.weights)
    return model


@pytest.mark.parametrize("chunk,block_size", [(None, 4), (5, 4), (1, 4), (3, 16), (7, 1)])
def test_batched_chunked_scattered_equals_alone(tiny_model, chunk, block_size):
    together = run_paged(tiny_model, SEQS, chunk=chunk, block_size=block_size, seed=chunk or 0)
    for seq, logits in zip(SEQS, together):
        alone = run_paged(tiny_model, [seq], block_size=block_size, seed=99)[0]
        assert logits.shape == (len(seq), 260)
        assert torch.allclose(logits, alone, atol=1e-5, rtol=0)


def test_decode_one_token_at_a_time_equals_prefill(tiny_model):
    seq = SEQS[0]
    assert torch.allclose(run_paged(tiny_model, [seq], chunk=1)[0],
                          run_paged(tiny_model, [seq])[0], atol=1e-5, rtol=0)


def test_matches_transformers_in_a_batch(tiny_model, tiny_llama):
    together = run_paged(tiny_model, SEQS, chunk=4)
    for seq, logits in zip(SEQS, together):
        with torch.no_grad():
            reference = tiny_llama(torch.tensor([seq])).logits[0]
        assert torch.allclose(logits, reference, atol=1e-4, rtol=0)


def test_bfloat16_model_keeps_float32_logits_close(tiny_llama_folder, tiny_llama):
    checkpoint = load_checkpoint(tiny_llama_folder)
    model = build_model(checkpoint.config, checkpoint.weights, dtype=torch.bfloat16)
    logits = run_paged(model, [SEQS[0]])[0]
    assert logits.dtype == torch.float32
    with torch.no_grad():
        reference = tiny_llama(torch.tensor([SEQS[0]])).logits[0]
    # bf16 has ~3 significant digits; the tiny model's logits are O(10).
    assert (logits - reference).abs().max() < 0.5
    assert (logits.argmax(-1) == reference.argmax(-1)).float().mean() > 0.8


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk", [None, 1, 3])
def test_batched_backend_matches_reference_backend(at_isa, tiny_llama_folder, dtype, chunk):
    checkpoint = load_checkpoint(tiny_llama_folder)
    results = {}
    for backend in ("batched", "torch-reference"):
        model = build_model(checkpoint.config, checkpoint.weights, dtype=dtype, attention_backend=backend)
        if backend == "batched":  # the fused C++ layer ops of the level under test (head_dim
            assert model.stack.norm.ops.isa() == at_isa  # 16 is below the attention kernels' shapes)
        # Mixed steps: long sequences still prefilling next to ones already decoding.
        results[backend] = run_paged(model, SEQS, chunk=chunk, block_size=4, seed=5)
    tolerance = 1e-5 if dtype == torch.float32 else 0.1
    for fast, reference in zip(results["batched"], results["torch-reference"]):
        assert (fast - reference).abs().max() <= tolerance


def test_fused_projections_keep_canonical_weights(tiny_llama_folder):
    from pagedllm.weights.fuse import fuse_projections
    checkpoint = load_checkpoint(tiny_llama_folder)
    fused = fuse_projections(checkpoint.weights, checkpoint.config.num_layers)
    q = checkpoint.weights["layers.0.self_attn.q_proj.weight"]
    assert torch.equal(fused["layers.0.self_attn.qkv_proj.weight"][: q.shape[0]], q)
    assert "layers.1.mlp.gate_proj.weight" not in fused
