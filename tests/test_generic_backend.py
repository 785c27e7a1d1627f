"""The generic torch path: the CUDA backend's code (dense weights in the model dtype on the
backend's device, torch's layer ops and paged attention, logits sampled on the host), run
here on the CPU (`device="torch-cpu"`), so CI tests every line of it. On a GPU machine
scripts/gpu_check.sh runs this same file with PAGEDLLM_TEST_DEVICE=cuda.

What it must give: the float32 logits of transformers on the same weights (every family's
features: windows, soft caps, q/k norms, experts), greedy output equal to transformers',
bfloat16 close to float32, and every KV block back in the pool after preemption and aborts.
"""
from __future__ import annotations

import os

DEVICE = os.environ.get("PAGEDLLM_TEST_DEVICE", "torch-cpu")
if DEVICE != "cuda":  # the Triton attention below runs under its interpreter (before import)
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from paged_helpers import run_aborting, run_paged, transformers_greedy  # noqa: E402
from pagedllm import LLM, SamplingParams  # noqa: E402
from pagedllm.backends import choose_backend  # noqa: E402
from pagedllm.backends.cpu import generic_backend  # noqa: E402
from pagedllm.core import sizing  # noqa: E402
from pagedllm.models.build import build_model  # noqa: E402
from pagedllm.weights import load_checkpoint  # noqa: E402
from tiny_models import tiny_hf_model, write_hf_folder  # noqa: E402

if DEVICE == "cuda" and not torch.cuda.is_available():
    pytest.skip("PAGEDLLM_TEST_DEVICE=cuda without a GPU", allow_module_level=True)
TENSOR_DEVICE = "cuda" if DEVICE == "cuda" else "cpu"
SEQS = [list(range(3, 60)), [7, 3, 9, 200, 15, 15, 16, 80, 81], [42], list(range(100, 140))]


@pytest.fixture(scope="module")
def backend():
    return choose_backend(DEVICE)


@pytest.mark.parametrize("arch", ["llama", "gemma2", "qwen3", "mixtral"])
@pytest.mark.parametrize("chunk", [None, 5])
def test_float32_logits_match_transformers(arch, chunk, backend, tmp_path):
    reference = tiny_hf_model(arch, seed=3)
    checkpoint = load_checkpoint(write_hf_folder(reference, tmp_path))
    model = build_model(checkpoint.config, checkpoint.weights, backend=backend)
    assert model.decode_loop is None and next(model.stack.parameters()).device.type == TENSOR_DEVICE
    together = run_paged(model, SEQS, chunk=chunk, device=TENSOR_DEVICE)
    for seq, logits in zip(SEQS, together):
        with torch.no_grad():
            expected = reference(torch.tensor([seq])).logits[0]
        assert (logits - expected).abs().max() < 1e-4, (arch, len(seq))


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_the_triton_attention_wired_in_matches_transformers(arch, tmp_path):
    """The attention the CUDA backend uses, inside the model: decode, chunked prefill, mixed
    steps, Gemma's window and caps (here under Triton's interpreter, on the GPU compiled)."""
    reference = tiny_hf_model(arch, seed=3)
    checkpoint = load_checkpoint(write_hf_folder(reference, tmp_path))
    backend = generic_backend(TENSOR_DEVICE, attention="triton")
    model = build_model(checkpoint.config, checkpoint.weights, backend=backend)
    assert model.stack.layers[0].self_attn.backend.name == "triton"
    seqs = [SEQS[1], list(range(100, 124))]
    for seq, logits in zip(seqs, run_paged(model, seqs, chunk=5, device=TENSOR_DEVICE)):
        with torch.no_grad():
            expected = reference(torch.tensor([seq])).logits[0]
        assert (logits - expected).abs().max() < 1e-4, (arch, len(seq))


def test_bfloat16_stays_close_to_float32(backend, tmp_path):
    reference = tiny_hf_model("llama", seed=3)
    checkpoint = load_checkpoint(write_hf_folder(reference, tmp_path))
    model = build_model(checkpoint.config, checkpoint.weights, dtype=torch.bfloat16,
                        backend=backend)
    assert model.stack.layers[0].self_attn.qkv_proj.weight.dtype == torch.bfloat16
    logits = run_paged(model, SEQS[:1], chunk=7, device=TENSOR_DEVICE)[0]
    with torch.no_grad():
        expected = reference(torch.tensor([SEQS[0]])).logits[0]
    agree = (logits.argmax(-1) == expected.argmax(-1)).float().mean().item()
    assert agree > 0.8


def test_the_default_model_greedy_equals_transformers(hf_reference):
    """The real GGUF, float32, several requests batched: token for token."""
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
    llm = LLM(dtype="float32", kv_cache_memory=64 << 20, device=DEVICE)
    ids = [llm.engine.tokenizer.encode(p) for p in prompts]
    ours = llm.generate(ids, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    for prompt, out in zip(ids, ours):
        assert out.token_ids == transformers_greedy(hf_reference, prompt, 16)


def test_blocks_come_back_after_preemption_and_aborts(tmp_path):
    reference = tiny_hf_model("llama", seed=5)
    folder = write_hf_folder(reference, tmp_path)
    prompts = [[11, 12, 13, 14] * 3 + [20 + i] for i in range(6)]
    roomy = LLM(folder, dtype="float32", kv_cache_memory=8 << 20, device=DEVICE)
    want = {tuple(o.prompt_token_ids): o.token_ids
            for o in roomy.generate(prompts, SamplingParams(temperature=0, max_tokens=40))}
    tight = LLM(folder, dtype="float32", block_size=4, max_model_len=64, max_num_seqs=6,
                kv_cache_memory=64 << 10, device=DEVICE)  # 512 B a token: 32 blocks of 4
    engine = tight.engine
    assert engine.kv_manager.num_blocks == 32
    ids, aborted, done = run_aborting(engine, prompts,
                                      SamplingParams(temperature=0, max_tokens=40))
    assert engine.scheduler.stats.num_preemptions > 0
    for rid, prompt in zip(ids, prompts):
        if rid not in aborted:
            assert done[rid].token_ids == want[tuple(prompt)]
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_blocks


def test_the_gpu_kv_pool_is_what_the_utilization_leaves():
    gib = 1 << 30
    # 80 GiB card, 10 GiB in use (weights, others): 0.9 of it is 72 GiB, 62 GiB for KV.
    assert sizing.gpu_kv_memory(70 * gib, 80 * gib, 0.9) == 62 * gib
    assert sizing.gpu_kv_memory(5 * gib, 80 * gib, 0.9) == 0  # others hold the card
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        sizing.gpu_kv_memory(1, 2, 1.5)


def test_a_draft_model_is_refused_on_the_generic_path(tmp_path):
    from pagedllm.config import SpeculativeConfig

    folder = write_hf_folder(tiny_hf_model("llama", seed=5), tmp_path)
    with pytest.raises(ValueError, match="does not run on the generic torch path"):
        LLM(folder, dtype="float32", kv_cache_memory=8 << 20, device=DEVICE,
            speculative=SpeculativeConfig(method="draft", draft_model=folder))
