"""The C++ decoder-layer loop for decode steps (kernels/decode_layers.cpp via DecodeLoop):
bit-identical to the Python layers, taken only where it applies."""
import pytest
import torch

from paged_helpers import make_kv_caches, run_paged
from pagedllm.attention import AttentionMetadata
from pagedllm.models.decode_loop import DecodeLoop


@pytest.fixture(scope="module")
def fast_model():
    from pagedllm import LLM

    model = LLM(dtype="bfloat16", kv_cache_memory=64 << 20).engine.runner.model
    if model.decode_loop is None:
        pytest.skip("the fast bfloat16 path (C++ kernels with q4_gemm) is not built here")
    return model


def test_decode_loop_is_bit_identical_to_the_python_layers(fast_model, monkeypatch):
    seqs = [[1, 504, 3300, 28, 253, 1135, 30, 216], [9690, 17, 2],
            list(range(100, 140)), [4, 5, 6, 7, 8, 9]]
    calls = []
    original = DecodeLoop.__call__

    def counted(self, *args):
        calls.append(args[0].shape[0])
        return original(self, *args)

    monkeypatch.setattr(DecodeLoop, "__call__", counted)
    # One token per sequence per step: every step is decode-only, batches of 4 shrinking to 1.
    fast = run_paged(fast_model, seqs, block_size=16, chunk=1)
    assert len(calls) == max(map(len, seqs)) and set(calls) == {1, 2, 3, 4}
    monkeypatch.setattr(fast_model, "decode_loop", None)
    slow = run_paged(fast_model, seqs, block_size=16, chunk=1)
    for f, s in zip(fast, slow):
        assert torch.equal(f, s)


def test_decode_loop_applies_to_decode_only_steps(fast_model):
    loop = fast_model.decode_loop
    assert loop.max_rows == 128 and len(loop.weights) == 6 * fast_model.config.num_layers
    decode = AttentionMetadata.build([5, 40], [0, 1, 2], [6, 9], [[0], [2]], 16)
    mixed = AttentionMetadata.build([5, 40, 41], [0, 1, 3], [6, 10], [[0], [2]], 16)
    assert loop.applies(decode, 2)
    assert not loop.applies(mixed, 3)  # a prefill chunk rides along: the Python layers
    many = AttentionMetadata.build(list(range(129)), list(range(130)), [1] * 129,
                                   [[i // 16] for i in range(129)], 16)
    assert not loop.applies(many, 129)  # beyond q4_gemm's rows the dense GEMM takes over


def test_decode_loop_is_built_only_on_the_fast_path(tiny_llama_gguf):
    from pagedllm import LLM

    exact = LLM(dtype="float32", kv_cache_memory=8 << 20).engine.runner.model
    assert exact.decode_loop is None and DecodeLoop.build(exact) is None
    # The tiny test model is float32-only GGUF (no 4-bit projections): no loop either.
    tiny = LLM(model=str(tiny_llama_gguf), dtype="bfloat16", kv_cache_memory=8 << 20).engine.runner.model
    assert tiny.decode_loop is None


def test_decode_layers_rejects_mismatched_arguments(fast_model):
    loop = fast_model.decode_loop
    config = fast_model.config
    kv = make_kv_caches(config, 4, 16, torch.bfloat16)
    hidden = torch.zeros(1, config.hidden_size, dtype=torch.bfloat16)
    args = (torch.tensor([0]), loop.cos, loop.sin)
    tail = (torch.tensor([0]), torch.zeros(1, 1, dtype=torch.long), torch.tensor([1]),
            loop.num_heads, loop.eps, loop.scale)
    with pytest.raises(RuntimeError, match="6 weights and a key and value cache per layer"):
        loop.ops.decode_layers(hidden, *args, loop.weights[:-1], [k for k, _ in kv],
                               [v for _, v in kv], *tail)
    with pytest.raises(RuntimeError, match="one decode token per sequence"):
        loop.ops.decode_layers(hidden.expand(2, -1), *args, loop.weights, [k for k, _ in kv],
                               [v for _, v in kv], *tail)
