"""The generic torch path: the CUDA backend's code (dense weights in the model dtype on the
backend's device, torch's layer ops and paged attention, logits sampled on the host), run
here on the CPU (`device="torch-cpu"`), so CI tests every line of it. On a GPU machine
scripts/gpu_check.sh runs this same file with PAGEDLLM_TEST_DEVICE=cuda.

What it must give: the float32 logits of transformers on the same weights (every family's
features: windows, soft caps, q/k norms, experts), greedy output equal to transformers',
bfloat16 close to float32, and every KV block back in the pool after preemption and aborts.
"""
from __future__ import annotations

from gpu_path import (DEVICE, ON as TENSOR_DEVICE, build_engines_as_on_the_gpu,  # (first:
                      skip_without_the_gpu)  # it switches Triton's interpreter on)

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

skip_without_the_gpu()
SEQS = [list(range(3, 60)), [7, 3, 9, 200, 15, 15, 16, 80, 81], [42], list(range(100, 140))]
# A graphed engine's block tables are as wide as its longest context, and over SPLIT_BLOCKS
# blocks a decode step reads every context in 16 splits: 16 times the programs, which Triton's
# interpreter runs one by one. Graph tests take this context (9 blocks: unsplit) but one,
# which keeps the model's 512 and so the splits inside the graphs.
UNSPLIT_LEN = 128


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


@pytest.mark.parametrize("arch", ["llama", "gemma2", "qwen3", "mixtral"])
def test_the_triton_attention_wired_in_matches_transformers(arch, tmp_path):
    """The attention and layer ops the CUDA backend uses, inside the model: decode, chunked
    prefill, mixed steps, Gemma's window and caps (here under Triton's interpreter, on the
    GPU compiled)."""
    reference = tiny_hf_model(arch, seed=3)
    checkpoint = load_checkpoint(write_hf_folder(reference, tmp_path))
    backend = generic_backend(TENSOR_DEVICE, attention="triton", layer_ops="triton")
    model = build_model(checkpoint.config, checkpoint.weights, backend=backend)
    assert model.stack.layers[0].self_attn.backend.name == "triton"
    assert model.stack.layers[0].self_attn.ops.__name__ == "TritonLayerOps"
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


# One layer of the default model's shape (SmolLM2-135M: 9 heads of 64, 3 KV heads) and of
# Qwen3-1.7B's (16 heads of 128, 8 KV heads): what their kernels are launched with.
GPU_MODEL_SHAPES = {
    "smollm2-135m": ("llama", dict(hidden_size=576, intermediate_size=1536, head_dim=64,
                                   num_attention_heads=9, num_key_value_heads=3)),
    "qwen3-1.7b": ("qwen3", dict(hidden_size=2048, intermediate_size=6144, head_dim=128,
                                 num_attention_heads=16, num_key_value_heads=8)),
}


@pytest.mark.parametrize("shape", sorted(GPU_MODEL_SHAPES))
def test_bfloat16_engines_of_the_gpu_models_shapes(shape, monkeypatch, tmp_path):
    """What the default GPU model (bfloat16, head size 64) and Qwen3's (128) launch: an engine
    through the Triton kernels, prefill then batched decode, whose first tokens are float32's
    (the compile check for real cards, scripts/compile_gpu_kernels.py, takes these launches)."""
    build_engines_as_on_the_gpu(monkeypatch, layer_ops="triton")
    arch, config = GPU_MODEL_SHAPES[shape]
    reference = tiny_hf_model(arch, seed=3, num_hidden_layers=1, **config)
    folder = write_hf_folder(reference, tmp_path)
    prompts = [SEQS[1], SEQS[3][:20]]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    outs = {dtype: LLM(folder, dtype=dtype, kv_cache_memory=16 << 20, device=DEVICE
                       ).generate(prompts, params) for dtype in ("bfloat16", "float32")}
    assert all(len(out.token_ids) == 4 for out in outs["bfloat16"])
    assert [o.token_ids[0] for o in outs["bfloat16"]] == [o.token_ids[0] for o in outs["float32"]]
    with torch.no_grad():
        expected = [reference(torch.tensor([p])).logits[0, -1].argmax().item() for p in prompts]
    assert [o.token_ids[0] for o in outs["float32"]] == expected


def test_the_default_model_greedy_equals_transformers(hf_reference):
    """The real GGUF, float32, several requests batched: token for token (where its package
    is installed: the GPU machine has no room for it)."""
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
    # Shared with a store's other models: 4 full-context requests of 1 GiB, not 62 GiB...
    assert sizing.gpu_kv_memory(70 * gib, 80 * gib, 0.9, gib) == 4 * gib
    # ... at most half of what is left (here 3 GiB of it), nothing where nothing is
    assert sizing.gpu_kv_memory(11 * gib, 80 * gib, 0.9, gib) == 3 * gib // 2
    assert sizing.gpu_kv_memory(5 * gib, 80 * gib, 0.9, gib) == 0


def test_a_store_model_on_a_gpu_leaves_room_for_the_next(tmp_path, monkeypatch):
    """The engine's sizing on a GPU (its free memory stood in for): alone, the pool is all
    that --gpu-memory-utilization leaves; sharing the card (a store's model), 4 full-context
    requests' worth, so a second model loads beside it."""
    from pagedllm.config import EngineConfig
    from pagedllm.engine.kv_sizing import size_kv

    gib = 1 << 30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (70 * gib, 80 * gib))
    config = load_checkpoint(write_hf_folder(tiny_hf_model("llama"), tmp_path)).config
    full = sizing.kv_bytes_per_request(config, 4, "auto", config.max_position_embeddings, 16)
    alone, _, _, _ = size_kv(EngineConfig(model="m"), config, torch.float32, "cuda")
    shared, cache, _, _ = size_kv(EngineConfig(model="m", shares_device=True), config,
                                  torch.float32, "cuda")
    assert alone == 62 * gib
    assert shared == sizing.default_kv_memory(62 * gib, full) < alone
    assert cache.num_blocks * 16 >= 4 * config.max_position_embeddings


def test_a_draft_model_is_refused_on_the_generic_path(tmp_path):
    from pagedllm.config import SpeculativeConfig

    folder = write_hf_folder(tiny_hf_model("llama", seed=5), tmp_path)
    with pytest.raises(ValueError, match="does not run on the generic torch path"):
        LLM(folder, dtype="float32", kv_cache_memory=8 << 20, device=DEVICE,
            speculative=SpeculativeConfig(method="draft", draft_model=folder))


# -- CUDA graphs (engine/cuda_graphs.py): the buffers' contents here, capture on a GPU ---------

def test_graph_sizes_and_padding():
    from pagedllm.engine.cuda_graphs import DecodeRow, graph_size, pad_decode

    assert [graph_size(b, (1, 2, 4, 8)) for b in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, None]
    rows = [DecodeRow(11, 5, 2 * 4 + 1, (7, 2)), DecodeRow(12, 0, 3 * 4, (3,))]
    padded = pad_decode(rows, 4, width=3, block_size=4, scratch_block=9)
    assert padded.input_ids == [11, 12, 0, 0] and padded.positions == [5, 0, 0, 0]
    assert padded.slots == [9, 12, 36, 36]  # padding writes into the scratch block
    assert padded.ctx_lens == [6, 1, 1, 1]
    assert padded.tables == [[7, 2], [3, 9], [9, 9], [9, 9]]  # as wide as the widest row
    with pytest.raises(ValueError, match="do not fit"):
        pad_decode(rows * 3, 4, 3, 4, 9)
    with pytest.raises(ValueError, match="wider"):
        pad_decode([DecodeRow(1, 0, 0, (1, 2, 3, 4))], 1, 3, 4, 9)


def test_the_attention_reads_a_padded_layout_as_the_graphs_give_it():
    """The Triton attention given its per-token layout ready-made (static buffers, padding
    rows on a scratch block) answers the real rows exactly as when it builds the layout."""
    from pagedllm.attention import AttentionMetadata
    from pagedllm.attention.triton_paged import paged_attention
    from pagedllm.engine.cuda_graphs import DecodeRow, pad_decode

    torch.manual_seed(0)
    bs, heads, kv_heads, d, blocks = 4, 4, 2, 16, 12
    keys = torch.randn(blocks, bs, kv_heads, d, device=TENSOR_DEVICE)
    values = torch.randn_like(keys)
    tables, lens = [[3, 5, 1], [7]], [10, 2]
    rows = [DecodeRow(0, n - 1, t[(n - 1) // bs] * bs + (n - 1) % bs, tuple(t))
            for t, n in zip(tables, lens)]
    query = torch.randn(4, heads, d, device=TENSOR_DEVICE)  # 2 real rows + 2 of padding
    built = AttentionMetadata.build([r.slot for r in rows], [0, 1, 2], lens, tables, bs,
                                    TENSOR_DEVICE)
    want = paged_attention(query[:2], keys, values, built, d ** -0.5)
    padded = pad_decode(rows, 4, width=4, block_size=bs, scratch_block=blocks - 1)
    static = torch.full((4, 4), 99, dtype=torch.long)  # columns past the copy: stale ids
    static[:, :3] = torch.tensor(padded.tables)
    layout = tuple(torch.tensor(v, dtype=torch.long, device=TENSOR_DEVICE) for v in
                   (list(range(4)), padded.ctx_lens, static.tolist()))
    given = AttentionMetadata(slot_mapping=torch.tensor(padded.slots, device=TENSOR_DEVICE),
                              query_start_loc=list(range(5)), seq_lens=[1] * 4, block_size=bs,
                              device=TENSOR_DEVICE, token_layout=layout)
    got = paged_attention(query, keys, values, given, d ** -0.5)
    assert torch.equal(got[:2], want)


def test_cuda_graphs_need_the_gpu(tmp_path):
    folder = write_hf_folder(tiny_hf_model("llama", seed=5), tmp_path)
    with pytest.raises(ValueError, match="--cuda-graphs needs --device cuda"):
        LLM(folder, dtype="float32", kv_cache_memory=8 << 20, device="cpu", cuda_graphs=True)


@pytest.mark.parametrize("kv_cache_dtype,overlap,max_model_len",
                         [("auto", False, UNSPLIT_LEN), ("int8", True, None)])
def test_decode_steps_go_through_the_graph_buffers(tmp_path, monkeypatch, kv_cache_dtype,
                                                   overlap, max_model_len):
    """The graph path end to end (on the CPU its forward runs uncaptured over the static
    buffers, Triton under its interpreter): decode steps of 1-3 requests padded to the
    sizes (prefill steps through mixed_graphs.py's); greedy output equal to the path without
    graphs. An int8 cache with overlapped steps in one run (its layers once took a torch
    path that read host lists a graph has not; each decode token is then the step before's,
    written into the graph's input buffer on the device)."""
    from pagedllm.engine import cuda_graphs

    build_engines_as_on_the_gpu(monkeypatch)
    folder = write_hf_folder(tiny_hf_model("llama", seed=5), tmp_path)
    # Fewer tokens where each decode step runs 16 splits a context under the interpreter.
    max_tokens = 8 if max_model_len else 5
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    prompts = [[5, 6, 7, 8, 9], [11, 12], [40, 41, 42, 43, 44, 45, 46]]
    kwargs = dict(dtype="float32", kv_cache_memory=8 << 20, device=DEVICE,
                  kv_cache_dtype=kv_cache_dtype)
    plain = LLM(folder, cuda_graphs=False, **kwargs)
    want = [o.token_ids for o in plain.generate(prompts, params)]
    assert all(len(ids) == max_tokens for ids in want)  # no request failed
    sizes = []
    run = cuda_graphs.DecodeGraphs.run
    monkeypatch.setattr(cuda_graphs.DecodeGraphs, "run",
                        lambda self, rows, *pending: sizes.append(len(rows))
                        or run(self, rows, *pending))
    graphed = LLM(folder, cuda_graphs=True, max_num_seqs=4, overlap_steps=overlap,
                  max_model_len=max_model_len, **kwargs)
    assert graphed.engine.runner.graphs.sizes == (1, 2, 4)
    assert graphed.engine.runner.graphs.width == (9 if max_model_len else 33)  # 33: split
    assert [o.token_ids for o in graphed.generate(prompts, params)] == want
    assert sizes and set(sizes) <= {1, 2, 3}  # decode steps went through the buffers
    one = graphed.generate([prompts[0]], params)[0].token_ids
    assert one == want[0] and sizes[-1] == 1
    engine = graphed.engine
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_blocks


def test_query_tiles_of_a_graph_are_padded_with_empty_ones():
    from pagedllm.engine.mixed_graphs import query_tiles

    assert query_tiles([0, 5, 6, 9], 2, 8, 99) == [[0, 0, 0, 1, 2, 2, 99, 99],
                                                   [0, 2, 4, 5, 6, 8, 0, 0],
                                                   [2, 2, 1, 1, 2, 1, 0, 0]]


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_prefill_steps_go_through_the_mixed_graph_buffers(tmp_path, monkeypatch, family):
    """Steps with prefill chunks through engine/mixed_graphs.py's buffers (on the CPU their
    forward uncaptured, Triton under its interpreter): prompts longer than the step budget
    (chunked) beside decoding requests, padded to the token sizes; greedy output equal to
    the path without graphs, every block back. The llama with an int8 cache and overlapped
    steps (a decode token then the step before's, written into the ids on the device);
    Gemma 2 with its window layers' own pool."""
    from pagedllm.engine import mixed_graphs

    build_engines_as_on_the_gpu(monkeypatch)
    folder = write_hf_folder(tiny_hf_model(family, seed=5), tmp_path)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    prompts = [list(range(5, 80)), [11, 12], [7] * 30]
    kwargs = dict(dtype="float32", kv_cache_memory=8 << 20, device=DEVICE, max_num_seqs=4,
                  max_num_batched_tokens=64)
    if family == "llama":
        kwargs.update(kv_cache_dtype="int8", overlap_steps=True)
    want = [o.token_ids for o in LLM(folder, cuda_graphs=False, **kwargs).generate(prompts, params)]
    assert all(len(ids) == 4 for ids in want)
    tokens = []
    run = mixed_graphs.MixedGraphs.run
    monkeypatch.setattr(mixed_graphs.MixedGraphs, "run",
                        lambda self, step, *pending: tokens.append(len(step.input_ids))
                        or run(self, step, *pending))
    graphed = LLM(folder, cuda_graphs=True, **kwargs)
    assert graphed.engine.runner.mixed_graphs.sizes == (16, 32, 64)
    assert [o.token_ids for o in graphed.generate(prompts, params)] == want
    assert 64 in tokens and any(n < 64 for n in tokens)  # full steps and padded ones
    manager = graphed.engine.kv_manager
    assert manager.num_free_blocks == manager.num_blocks


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs are captured on a GPU only "
                    "(their buffers and the attention's use of them are tested above)")
def test_graph_replay_equals_eager_on_the_gpu(tmp_path):
    folder = write_hf_folder(tiny_hf_model("llama", seed=5), tmp_path)
    prompts = [[5, 6, 7, 8, 9], [11, 12], [40, 41, 42, 43, 44, 45, 46], [100] * 20]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    eager = LLM(folder, dtype="float32", kv_cache_memory=64 << 20, device="cuda")
    graphed = LLM(folder, dtype="float32", kv_cache_memory=64 << 20, device="cuda",
                  cuda_graphs=True, max_num_seqs=8)
    assert graphed.engine.runner.graphs.graphs  # captured
    want = [o.token_ids for o in eager.generate(prompts, params)]
    got = [o.token_ids for o in graphed.generate(prompts, params)]
    assert got == want
    assert graphed.engine.kv_manager.num_free_blocks == graphed.engine.kv_manager.num_blocks


def test_the_sampler_gives_the_same_tokens_where_the_logits_are():
    """Sampling runs where the logits are (on a GPU they stay there; the chosen ids come
    back): every parameter gives the tokens and logprobs the host gives for the same draws."""
    from pagedllm.engine.sampler import Sampler, SamplingRow

    logits = torch.randn(7, 300, generator=torch.Generator().manual_seed(0)) * 3
    params = [SamplingParams(temperature=0),
              SamplingParams(temperature=0.8, top_k=20, seed=1),
              SamplingParams(temperature=1.0, top_p=0.9, seed=2),
              SamplingParams(temperature=0.7, min_p=0.1, seed=3, logprobs=3),
              SamplingParams(temperature=0, repetition_penalty=1.3, presence_penalty=0.5,
                             frequency_penalty=0.2, logit_bias={5: 100.0}),
              SamplingParams(temperature=1.0, seed=4),
              SamplingParams(temperature=0.9, top_k=1200, top_p=0.999, seed=5)]

    def rows():
        return [SamplingRow(p, [1, 2, 3], [4, 5, 5], torch.Generator().manual_seed(p.seed)
                            if p.seed is not None else None) for p in params]

    host_ids, host_logprobs = Sampler()(logits.clone(), rows())
    ids, logprobs = Sampler()(logits.to(TENSOR_DEVICE), rows())
    assert ids == host_ids and ids[4] == 5  # the bias wins the greedy row
    assert logprobs[3].token_id == host_logprobs[3].token_id
    assert abs(logprobs[3].logprob - host_logprobs[3].logprob) < 1e-5
    assert [t for t, _ in logprobs[3].top] == [t for t, _ in host_logprobs[3].top]


@pytest.mark.parametrize("graphs", [False, True])
def test_ngram_speculation_on_the_generic_path_keeps_greedy_output(tmp_path, monkeypatch,
                                                                   graphs):
    """Verification steps (one single-token query a position) run on the generic path too,
    with graphs through their buffers like decode steps (more rows than requests):
    greedy output unchanged."""
    from pagedllm.config import SpeculativeConfig
    from pagedllm.engine import cuda_graphs

    folder = write_hf_folder(tiny_hf_model("llama", seed=5), tmp_path)
    prompts = [[11, 12, 13, 14, 15] * 6, [40, 41, 42, 43] * 5 + [40]]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    kwargs = dict(dtype="float32", kv_cache_memory=8 << 20, device=DEVICE)
    want = [o.token_ids for o in LLM(folder, **kwargs).generate(prompts, params)]
    rows = []
    if graphs:
        build_engines_as_on_the_gpu(monkeypatch)
        run = cuda_graphs.DecodeGraphs.run
        monkeypatch.setattr(cuda_graphs.DecodeGraphs, "run",
                            lambda self, r, *pending: rows.append(len(r)) or run(self, r, *pending))
        kwargs.update(cuda_graphs=True, max_num_seqs=16, max_model_len=UNSPLIT_LEN)
    fast = LLM(folder, speculative=SpeculativeConfig(method="ngram"), **kwargs)
    assert [o.token_ids for o in fast.generate(prompts, params)] == want
    assert fast.engine.speculator.stats.num_drafts > 0
    if graphs:  # verification steps replayed: more rows than the two requests
        assert max(rows) > 2
    engine = fast.engine
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_blocks


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_an_int8_cache_on_the_gpus_kernels_gives_the_torch_paths_logits(arch, tmp_path):
    """The Triton kernels write int8 codes and read them through their row scales: the same
    logits as the torch path over the same int8 cache (float32; chunked prefill, then decode
    positions), and close to transformers' (the int8 rounding alone apart)."""
    reference = tiny_hf_model(arch, seed=4)
    checkpoint = load_checkpoint(write_hf_folder(reference, tmp_path))
    seqs = [SEQS[1], list(range(100, 130))]
    logits = {}
    for name, attention, ops in (("torch", "batched", "torch"), ("triton", "triton", "triton")):
        model = build_model(checkpoint.config, checkpoint.weights, backend=generic_backend(
            TENSOR_DEVICE, attention=attention, layer_ops=ops))
        logits[name] = run_paged(model, seqs, chunk=7, kv_cache_dtype="int8",
                                 device=TENSOR_DEVICE)
    for seq, got, want in zip(seqs, logits["triton"], logits["torch"]):
        # 2e-6 to 4e-6 on most hosts. A key or value that sits at a rounding tie may get
        # codes one apart on the two paths (their float sums differ in the last bit), and
        # every later position then differs by ~1e-3: 2.7e-3 for Gemma 2 on an AMD EPYC
        # under Triton's interpreter, ~1e-3 on a GPU. A wrong scale or block is ~0.1 and up.
        assert (got - want).abs().max() < 1e-2, len(seq)
        with torch.no_grad():
            exact = reference(torch.tensor([seq])).logits[0]
        assert (got - exact).abs().max() < 0.1  # (4e-3 to 4e-2 here)


def test_split_contexts_inside_the_model_match_transformers(tmp_path, monkeypatch):
    """Flash-decoding's splits (a block each here) in every layer: the same logits."""
    from pagedllm.attention import triton_paged

    monkeypatch.setattr(triton_paged, "SPLIT_BLOCKS", 1)
    reference = tiny_hf_model("llama", seed=3)
    checkpoint = load_checkpoint(write_hf_folder(reference, tmp_path))
    backend = generic_backend(TENSOR_DEVICE, attention="triton", layer_ops="triton")
    model = build_model(checkpoint.config, checkpoint.weights, backend=backend)
    seqs = [SEQS[1], list(range(100, 124))]
    for seq, logits in zip(seqs, run_paged(model, seqs, chunk=5, device=TENSOR_DEVICE)):
        with torch.no_grad():
            expected = reference(torch.tensor([seq])).logits[0]
        assert (logits - expected).abs().max() < 1e-4, len(seq)


def test_sliding_window_models_decode_through_the_graph_buffers(tmp_path, monkeypatch):
    """Gemma 2 keeps its window layers' KV in a pool of their own: their slots and tables
    get static buffers too (and a scratch block there). Prompts longer than the window, so
    decode steps read tables whose slid-out entries point at the null block: greedy output
    equal to the path without graphs, every block of both pools back at the end."""
    from pagedllm.engine import cuda_graphs

    build_engines_as_on_the_gpu(monkeypatch)
    folder = write_hf_folder(tiny_hf_model("gemma2", seed=5), tmp_path)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    prompts = [list(range(5, 30)), [11, 12, 13], list(range(40, 60))]
    kwargs = dict(dtype="float32", kv_cache_memory=8 << 20, device=DEVICE, max_num_seqs=4)
    want = [o.token_ids for o in LLM(folder, cuda_graphs=False, **kwargs).generate(prompts, params)]
    sizes = []
    run = cuda_graphs.DecodeGraphs.run
    monkeypatch.setattr(cuda_graphs.DecodeGraphs, "run",
                        lambda self, rows, *pending: sizes.append(len(rows))
                        or run(self, rows, *pending))
    graphed = LLM(folder, cuda_graphs=True, max_model_len=UNSPLIT_LEN, **kwargs)
    assert graphed.engine.runner.graphs.window_slots is not None
    assert [o.token_ids for o in graphed.generate(prompts, params)] == want
    assert sizes  # decode steps went through the buffers
    manager = graphed.engine.kv_manager
    assert manager.num_free_blocks == manager.num_blocks


def test_lora_adapters_on_the_generic_path_answer_as_peft(monkeypatch, tmp_path):
    """Adapters and the base in one batch on the CUDA backend's path (here torch's grouped
    products on the CPU; on a GPU the Triton kernels, lora/triton_sgmv.py), greedy tokens
    as transformers + peft give them."""
    pytest.importorskip("peft", reason="peft makes the adapter (a test dependency; the GPU "
                                       "machine may not have it)")
    from pagedllm.config import LoRAConfig
    from test_lora_model import make_peft

    build_engines_as_on_the_gpu(monkeypatch)
    reference = tiny_hf_model("llama", seed=3)
    folder = write_hf_folder(reference, tmp_path / "model")
    adapted, adapter = make_peft(reference, tmp_path / "adapter")
    llm = LLM(folder, dtype="float32", kv_cache_memory=16 << 20, device=DEVICE,
              lora=LoRAConfig((("a", adapter),), max_loras=2, max_lora_rank=4))
    engine = llm.engine
    jobs = [("a", SEQS[1]), (None, SEQS[1]), ("a", SEQS[3])]
    ids = [engine.add_request(None, prompt, SamplingParams(
        temperature=0, max_tokens=8, ignore_eos=True, lora=name)).request_id
        for name, prompt in jobs]
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    for rid, (name, prompt) in zip(ids, jobs):
        oracle = adapted if name else reference
        assert done[rid].token_ids == transformers_greedy(oracle, prompt, 8), name
