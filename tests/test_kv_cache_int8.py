"""kv_cache_dtype "int8": K/V rows stored as int8 codes with a float32 scale each. The
rounding rule, the C++ writer and attention kernels against the torch reference on the
dequantized cache, bad arguments, and the engine's sizing and flag."""
import pytest
import torch

from pagedllm.attention import AttentionMetadata, LayerKVCache, TorchReferenceBackend, allocate_layer_caches
from pagedllm.attention.layer_cache import quantize_rows
from pagedllm.backends.torch_layer_ops import TorchLayerOps


def int8_cache(key: torch.Tensor, value: torch.Tensor) -> LayerKVCache:
    (key_codes, key_scale), (value_codes, value_scale) = quantize_rows(key), quantize_rows(value)
    return LayerKVCache(key_codes, value_codes, key_scale, value_scale)


def dequantized(cache: LayerKVCache) -> LayerKVCache:
    everything = slice(None)
    return LayerKVCache(cache.keys(everything), cache.values(everything))


def test_quantize_rows_rounds_each_row_to_its_own_scale():
    torch.manual_seed(0)
    x = torch.randn(5, 3, 64) * torch.tensor([1e-3, 1.0, 50.0]).view(1, 3, 1)
    x[0, 0] = 0.0  # an all-zero row
    codes, scale = quantize_rows(x)
    assert codes.dtype == torch.int8 and scale.dtype == torch.float32
    assert codes.shape == x.shape and scale.shape == (5, 3)
    assert scale[0, 0] == 0 and not codes[0, 0].any()
    # The largest element of each row is +-127; every element within half a step.
    assert (codes.abs().amax(-1)[1:] == 127).all()
    error = (codes.float() * scale.unsqueeze(-1) - x).abs()
    assert (error <= scale.unsqueeze(-1) / 2 + 1e-7).all()
    assert codes.min() >= -127


def test_allocate_int8_layer_caches():
    caches = allocate_layer_caches(2, 6, 16, 3, 64, torch.bfloat16, "int8")
    assert len(caches) == 2 and all(c.quantized for c in caches)
    assert caches[0].key.dtype == torch.int8 and caches[0].key.shape == (6, 16, 3, 64)
    assert caches[0].value_scale.dtype == torch.float32 and caches[0].value_scale.shape == (6, 16, 3)
    plain = allocate_layer_caches(1, 6, 16, 3, 64, torch.bfloat16)
    assert not plain[0].quantized and plain[0].key.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        allocate_layer_caches(1, 6, 16, 3, 64, torch.bfloat16, "fp8")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_write_kv_into_int8_cache_matches_torch(ops, dtype):
    from pagedllm.models.llama import RotaryEmbedding

    torch.manual_seed(2)
    heads, kv_heads, head_dim, tokens = 9, 3, 64, 20
    rotary = RotaryEmbedding(head_dim, 2048, 10000.0)
    qkv = (torch.randn(tokens, (heads + 2 * kv_heads) * head_dim) * 3).to(dtype)
    positions = torch.randint(0, 2048, (tokens,))
    slots = torch.randperm(8 * 16)[:tokens]
    fused, reference = (allocate_layer_caches(1, 8, 16, kv_heads, head_dim, dtype, "int8")[0]
                        for _ in range(2))
    for cache in (fused, reference):
        for tensor in cache:
            tensor.zero_()
    q_int8 = ops.rope_write_kv(qkv, positions, rotary.cos, rotary.sin, fused.key, fused.value,
                               slots, heads, fused.key_scale, fused.value_scale)
    # The reference rotates in float32, as the C++ writer does before rounding.
    TorchLayerOps.rope_write_kv(qkv.float(), positions, rotary.cos, rotary.sin, reference.key,
                                reference.value, slots, heads, reference.key_scale, reference.value_scale)
    plain = torch.zeros(8, 16, kv_heads, head_dim, dtype=dtype)
    q_plain = ops.rope_write_kv(qkv, positions, rotary.cos, rotary.sin, plain, plain.clone(), slots, heads)
    assert torch.equal(q_int8, q_plain)  # the query does not depend on the cache
    # Float rounding differences (the rotation; a reciprocal under -ffast-math) may move a
    # code that sits on a rounding boundary by one step, rarely.
    for fused_codes, reference_codes in ((fused.key, reference.key), (fused.value, reference.value)):
        assert (fused_codes.int() - reference_codes.int()).abs().max() <= 1
        assert (fused_codes != reference_codes).float().mean() < 0.01
    assert torch.allclose(fused.key_scale, reference.key_scale, rtol=1e-5, atol=0)
    assert torch.allclose(fused.value_scale, reference.value_scale, rtol=1e-6, atol=0)
    written = fused.key_scale.view(-1, kv_heads)[slots]
    assert (written > 0).all() and (fused.key.view(-1, kv_heads, head_dim)[slots].abs().amax(-1) == 127).all()


def random_layout(lens: list[int], block_size: int, num_blocks: int):
    order = torch.randperm(num_blocks).tolist()
    return [[order.pop() for _ in range(-(-n // block_size))] for n in lens]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (8, 8, 64), (16, 2, 128)])
def test_decode_kernel_over_int8_cache_matches_reference(ops, dtype, heads, kv_heads, head_dim):
    """The kernel multiplies int8 query codes by the key codes (AVX512-VNNI); the reference
    attends with the exact query over the dequantized cache, so the difference is the
    query's rounding."""
    torch.manual_seed(0)
    block_size, num_blocks = 16, 64
    lens = [1, 17, 300, 16, 45, 3]
    tables = random_layout(lens, block_size, num_blocks)
    shape = (num_blocks, block_size, kv_heads, head_dim)
    cache = int8_cache(torch.randn(shape), torch.randn(shape))
    query = torch.randn(len(lens), heads, head_dim, dtype=dtype)
    slots = [t[(n - 1) // block_size] * block_size + (n - 1) % block_size for t, n in zip(tables, lens)]
    meta = AttentionMetadata.build(slots, list(range(len(lens) + 1)), lens, tables, block_size)
    reference = TorchReferenceBackend(heads, kv_heads, head_dim).forward(query.float(), dequantized(cache), meta)
    batch = meta.decode_batch()
    out = ops.paged_decode_attention(query, cache.key, cache.value, batch.block_tables, batch.seq_lens,
                                     head_dim ** -0.5, cache.key_scale, cache.value_scale)
    assert out.dtype == dtype and out.shape == query.shape
    assert (out.float().flatten(1) - reference).abs().max() < 3e-2
    # and a float cache of the same numbers gives nearly the same answer
    plain = dequantized(cache)
    out_plain = ops.paged_decode_attention(query, plain.key.to(dtype), plain.value.to(dtype),
                                           batch.block_tables, batch.seq_lens, head_dim ** -0.5)
    assert (out.float() - out_plain.float()).abs().max() < 3e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("start,chunk,block_size", [(0, 37, 16), (45, 20, 16), (21, 70, 5), (0, 1, 16)])
def test_prefill_kernel_over_int8_cache_matches_reference(ops, dtype, start, chunk, block_size):
    """bfloat16 chunks take the tiled kernel (rows dequantized to bf16 as they are laid
    out), float32 the per-token kernel (integer q.k)."""
    torch.manual_seed(4)
    heads, kv_heads, head_dim, num_blocks = 9, 3, 64, 64
    seq_len = start + chunk
    table = random_layout([seq_len], block_size, num_blocks)[0]
    shape = (num_blocks, block_size, kv_heads, head_dim)
    cache = int8_cache(torch.randn(shape), torch.randn(shape))
    query = torch.randn(chunk, heads, head_dim, dtype=dtype)
    slots = [table[p // block_size] * block_size + p % block_size for p in range(start, seq_len)]
    meta = AttentionMetadata.build(slots, [0, chunk], [seq_len], [table], block_size)
    reference = TorchReferenceBackend(heads, kv_heads, head_dim).forward(query.float(), dequantized(cache), meta)
    out = ops.paged_prefill_attention(query, cache.key, cache.value, meta.blocks_of(0), start,
                                      head_dim ** -0.5, cache.key_scale, cache.value_scale)
    assert out.dtype == dtype
    assert (out.float().flatten(1) - reference).abs().max() < 3e-2


def test_attention_kernels_reject_mismatched_caches(ops):
    query = torch.randn(1, 9, 64)
    codes = torch.zeros(4, 16, 3, 64, dtype=torch.int8)
    scales = torch.ones(4, 16, 3)
    tables, lens = torch.tensor([[0]]), torch.tensor([5])
    decode = ops.paged_decode_attention
    with pytest.raises(RuntimeError, match="needs key and value scales"):
        decode(query, codes, codes, tables, lens, 0.125)
    with pytest.raises(RuntimeError, match="needs key and value scales"):
        decode(query, codes, codes, tables, lens, 0.125, scales)  # the value scales missing
    with pytest.raises(RuntimeError, match="takes none"):
        decode(query, torch.zeros(4, 16, 3, 64), torch.zeros(4, 16, 3, 64), tables, lens, 0.125,
               scales, scales)
    with pytest.raises(RuntimeError, match=r"scales must be contiguous float32 \[num_blocks"):
        decode(query, codes, codes, tables, lens, 0.125, torch.ones(4, 16, 2), scales)
    with pytest.raises(RuntimeError, match="scales must be contiguous float32"):
        decode(query, codes, codes, tables, lens, 0.125, scales.double(), scales)
    with pytest.raises(RuntimeError, match="int8 or in the activations' dtype"):
        decode(query, codes.to(torch.uint8), codes.to(torch.uint8), tables, lens, 0.125, scales, scales)
    with pytest.raises(RuntimeError, match="key and value cache dtypes differ"):
        decode(query, codes, codes.float(), tables, lens, 0.125, scales, scales)
    with pytest.raises(RuntimeError, match="contiguous, 4-D and alike"):
        decode(query, codes, codes[:2], tables, lens, 0.125, scales, scales)
    with pytest.raises(RuntimeError, match="needs key and value scales"):
        ops.paged_prefill_attention(query, codes, codes, torch.tensor([0]), 0, 0.125)
    qkv, cos = torch.randn(1, (9 + 6) * 64), torch.ones(16, 64)
    with pytest.raises(RuntimeError, match="needs key and value scales"):
        ops.rope_write_kv(qkv, torch.tensor([0]), cos, cos, codes, codes, torch.tensor([0]), 9)
    with pytest.raises(RuntimeError, match="scales must be contiguous float32"):
        ops.rope_write_kv(qkv, torch.tensor([0]), cos, cos, codes, codes, torch.tensor([0]), 9,
                          scales[:2], scales)


def test_engine_int8_cache_holds_more_tokens_and_generates():
    from pagedllm import LLM, SamplingParams
    from pagedllm.core import sizing

    auto = LLM(dtype="bfloat16", kv_cache_memory=16 << 20)
    int8 = LLM(dtype="bfloat16", kv_cache_memory=16 << 20, kv_cache_dtype="int8")
    config = int8.engine.model_config
    per_token = sizing.kv_bytes_per_token(config, 2, "int8")
    assert per_token == 2 * config.num_layers * config.num_kv_heads * (config.head_dim + 4)
    assert int8.engine.capacity_tokens == (16 << 20) // (per_token * 16) * 16
    assert int8.engine.capacity_tokens > 1.8 * auto.engine.capacity_tokens
    assert int8.engine.runner.kv_caches[0].quantized
    params = SamplingParams(max_tokens=8, temperature=0)
    out = int8.generate(["The capital of France is"], params)[0]
    assert "Paris" in out.text
    # Blocks go back to the pool when requests finish, as with the float cache.
    assert int8.engine.kv_manager.num_free_blocks == int8.engine.cache_config.num_blocks


def test_engine_rejects_unknown_kv_cache_dtype():
    from pagedllm import LLM

    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, int8"):
        LLM(dtype="bfloat16", kv_cache_memory=16 << 20, kv_cache_dtype="fp8")


def test_cli_passes_kv_cache_dtype(capsys):
    from pagedllm.cli import build_parser, engine_config

    args = build_parser().parse_args(["serve", "--kv-cache-dtype", "int8"])
    assert engine_config(args).kv_cache_dtype == "int8"
    assert engine_config(build_parser().parse_args(["serve"])).kv_cache_dtype == "auto"
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["serve", "--kv-cache-dtype", "fp8"])
    assert exit_info.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


def test_plan_sizes_an_int8_cache(capsys):
    from pagedllm.cli import main

    assert main(["plan", "--dtype", "bfloat16", "--kv-cache-dtype", "int8", "--context", "2048",
                 "--parallel", "1,8", "--memory", "1GiB"]) == 0
    text = capsys.readouterr().out
    assert "KV cache (int8): 12,240 bytes per token" in text  # 2 x 30 x 3 x (64 + 4)
    assert "--kv-cache-dtype int8" in text


def test_server_with_int8_cache_serves_and_says_so(tmp_path):
    """`pagedllm serve --kv-cache-dtype int8` through the official client: streamed and
    whole completions agree, bad input still gets its 400, and /metrics names the cache."""
    import httpx
    import openai
    from prometheus_client.parser import text_string_to_metric_families
    from server_process import ServerProcess

    proc = ServerProcess("--kv-cache-dtype", "int8", "--kv-cache-memory", str(64 << 20),
                         "--served-model-name", "smollm2", log_path=str(tmp_path / "log"))
    try:
        client = openai.OpenAI(base_url=proc.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        kwargs = dict(model="smollm2", prompt="The capital of France is", max_tokens=8, temperature=0)
        whole = client.completions.create(**kwargs).choices[0].text
        streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kwargs)
                           if c.choices)
        assert "Paris" in whole and streamed == whole
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model="smollm2", prompt="x", max_tokens=-1)
        text = httpx.get(proc.url + "/metrics").text
        [info] = [f for f in text_string_to_metric_families(text) if f.name == "pagedllm:cache_config_info"]
        assert info.samples[0].labels["cache_dtype"] == "int8"
        assert "KV cache (int8)" in proc.output()
    finally:
        assert proc.stop() == 0
