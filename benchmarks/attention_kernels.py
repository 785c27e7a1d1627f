"""C++ paged attention against the torch paths it replaced, at the default model's shapes.

    .venv/bin/python benchmarks/attention_kernels.py [--threads 2]

Decode: S sequences of L tokens, one query each, 30 layers with their own caches (so K/V
stream from memory as in serving); baseline: the torch gather path (block tables padded,
K/V gathered, masked matmuls). Prefill: one chunk of tokens attending causally, from the
sequence's start or continuing it; baselines: gather + expanded KV heads + torch's fused SDPA
(what the backend did first; from the start only), and the per-token C++ kernel the tiled
one replaced (kernels/prefill_attention.cpp). bfloat16, 9 query heads over 3 KV heads,
head_dim 64, blocks of 16 scattered at random. glibc's allocator is set as in a serving
process first (timing.allocate_as_a_loaded_engine), so that the torch baselines' figures do
not depend on what the script freed before. Both also with an int8 cache
(`--kv-cache-dtype int8`: the same K/V as codes and scales) against the bfloat16 one.
"""
from __future__ import annotations


import torch
import torch.nn.functional as F

from pagedllm.attention import AttentionMetadata, LayerKVCache
from pagedllm.attention.batched import BatchedBackend
from pagedllm.attention.layer_cache import quantize_rows
from pagedllm.kernels import kernel_ops
from timing import allocate_as_a_loaded_engine, ms_per_call, parse_args, smoke_or

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
SCALE = HEAD_DIM ** -0.5


def int8_cache(key: torch.Tensor, value: torch.Tensor) -> LayerKVCache:
    (key_codes, key_scale), (value_codes, value_scale) = quantize_rows(key), quantize_rows(value)
    return LayerKVCache(key_codes, value_codes, key_scale, value_scale)


def decode_case(ops, torch_backend, seqs: int, length: int, heads: int = HEADS,
                kv_heads: int = KV_HEADS, layers: int = 30) -> tuple[float, float, float]:
    """(torch gather ms, C++ ms, C++ ms over the int8 cache)."""
    blocks = -(-length // BLOCK)
    num_blocks = seqs * blocks + 1
    caches = [LayerKVCache(torch.randn(num_blocks, BLOCK, kv_heads, HEAD_DIM).bfloat16(),
                           torch.randn(num_blocks, BLOCK, kv_heads, HEAD_DIM).bfloat16())
              for _ in range(layers)]
    int8_caches = [int8_cache(c.key, c.value) for c in caches]
    tables = torch.randperm(num_blocks)[: seqs * blocks].view(seqs, blocks).tolist()
    slots = [t[(length - 1) // BLOCK] * BLOCK + (length - 1) % BLOCK for t in tables]
    meta = AttentionMetadata.build(slots, list(range(seqs + 1)), [length] * seqs, tables, BLOCK)
    batch = meta.decode_batch()
    query = torch.randn(seqs, heads, HEAD_DIM).bfloat16()

    def kernel(layer_caches=caches):
        for c in layer_caches:
            ops.paged_decode_attention(query, c.key, c.value, batch.block_tables, batch.seq_lens,
                                       SCALE, c.key_scale, c.value_scale)

    def gather():
        for c in caches:
            torch_backend._decode(query, c, batch)

    return ms_per_call(gather), ms_per_call(kernel), ms_per_call(lambda: kernel(int8_caches))


def prefill_case(ops, length: int, start: int = 0) -> tuple[float, float, float, float]:
    """A chunk of `length` tokens at positions start.. over scattered blocks, one layer:
    (SDPA ms, or nan past position 0; the per-token kernel's ms; the tiled kernel's ms; the
    tiled kernel's over the int8 cache). The
    per-token figure runs the decode kernel with each token as a one-query sequence over the
    chunk's table, which is what the prefill entry point did before the tiled kernel."""
    total = start + length
    blocks = -(-total // BLOCK)
    k_cache = torch.randn(blocks + 4, BLOCK, KV_HEADS, HEAD_DIM).bfloat16()
    v_cache = torch.randn_like(k_cache)
    table = torch.randperm(blocks + 4)[:blocks]
    query = torch.randn(length, HEADS, HEAD_DIM).bfloat16()
    group = HEADS // KV_HEADS
    tables = table.unsqueeze(0).expand(length, -1).contiguous()
    lens = torch.arange(start + 1, total + 1)

    def sdpa():
        keys = k_cache[table].flatten(0, 1)[:length].transpose(0, 1).repeat_interleave(group, 0)
        values = v_cache[table].flatten(0, 1)[:length].transpose(0, 1).repeat_interleave(group, 0)
        return F.scaled_dot_product_attention(query.transpose(0, 1).unsqueeze(0), keys.unsqueeze(0),
                                              values.unsqueeze(0), is_causal=True, scale=SCALE)

    def per_token():
        return ops.paged_decode_attention(query, k_cache, v_cache, tables, lens, SCALE)

    def tiled():
        return ops.paged_prefill_attention(query, k_cache, v_cache, table, start, SCALE)

    quantized = int8_cache(k_cache, v_cache)

    def tiled_int8():
        return ops.paged_prefill_attention(query, quantized.key, quantized.value, table, start, SCALE,
                                           quantized.key_scale, quantized.value_scale)

    assert (per_token().float() - tiled().float()).abs().max() < 2e-2  # the same attention
    assert (tiled_int8().float() - tiled().float()).abs().max() < 5e-2
    base = ms_per_call(sdpa, 20) if start == 0 else float("nan")
    return base, ms_per_call(per_token, 20), ms_per_call(tiled, 20), ms_per_call(tiled_int8, 20)


def main() -> None:
    args = parse_args()
    allocate_as_a_loaded_engine()
    ops = kernel_ops()
    assert ops is not None, "the C++ kernels did not build (make install builds them)"
    torch_backend = BatchedBackend(HEADS, KV_HEADS, HEAD_DIM)
    print(f"threads={args.threads}, bfloat16, {HEADS} heads / {KV_HEADS} KV heads, head_dim {HEAD_DIM}")
    print("decode, 30 layers:   torch gather ms   C++ ms   speed-up   C++ int8 cache ms   bf16/int8")
    for seqs, length in smoke_or(((1, 600), (1, 2000), (8, 600), (16, 600), (16, 1500)), ((2, 40),)):
        base, ours, int8 = decode_case(ops, torch_backend, seqs, length, layers=smoke_or(30, 1))
        print(f"  S={seqs:>2} L={length:>4}      {base:9.2f}   {ours:8.2f}   {base / ours:6.2f}x"
              f"   {int8:17.2f}   {ours / int8:8.2f}x")
    print("decode, SmolLM2-1.7B's heads (32 over 32 KV heads: a head's rows 4 KB apart), 24 layers:")
    wide = BatchedBackend(32, 32, HEAD_DIM)
    for length in smoke_or((330, 1000, 2000), (40,)):
        base, ours, int8 = decode_case(ops, wide, 1, length, 32, 32, smoke_or(24, 1))
        print(f"  S= 1 L={length:>4}      {base:9.2f}   {ours:8.2f}   {base / ours:6.2f}x"
              f"            {int8:8.2f}     {ours / int8:5.2f}x")
    print("prefill chunk, one layer:  SDPA ms  per-token ms  tiled ms  SDPA/tiled  per-token/tiled"
          "  tiled int8 ms  bf16/int8")
    for length, start in smoke_or(((256, 0), (450, 0), (768, 0), (256, 768), (256, 2048),
                                   (512, 3584)), ((32, 0), (16, 32))):
        base, per_token, tiled, tiled_int8 = prefill_case(ops, length, start)
        sdpa = f"{base:8.2f} " if start == 0 else f"{'-':>8} "
        sdpa_ratio = f"{base / tiled:10.2f}x" if start == 0 else f"{'-':>11}"
        print(f"  {length:>4} tokens from {start:>4} {sdpa}{per_token:13.2f} {tiled:9.2f}"
              f" {sdpa_ratio} {per_token / tiled:15.2f}x {tiled_int8:14.2f} {tiled / tiled_int8:9.2f}x")


if __name__ == "__main__":
    main()
