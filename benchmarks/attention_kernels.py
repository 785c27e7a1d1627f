"""C++ paged attention against the torch paths it replaced, at the default model's shapes.

    .venv/bin/python benchmarks/attention_kernels.py [--threads 2]

Decode: S sequences of L tokens, one query each, 30 layers with their own caches (so K/V
stream from memory as in serving); baseline: the torch gather path (block tables padded,
K/V gathered, masked matmuls). Prefill: one chunk of L tokens attending causally; baseline:
gather + expanded KV heads + torch's fused SDPA (what the backend did before). bfloat16,
9 query heads over 3 KV heads, head_dim 64, blocks of 16 scattered at random.
"""
from __future__ import annotations


import torch
import torch.nn.functional as F

from pagedllm.attention import AttentionMetadata
from pagedllm.attention.batched import BatchedBackend
from pagedllm.kernels import kernel_ops
from timing import ms_per_call, parse_args

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
SCALE = HEAD_DIM ** -0.5


def decode_case(ops, torch_backend, seqs: int, length: int) -> tuple[float, float]:
    blocks = -(-length // BLOCK)
    num_blocks = seqs * blocks + 1
    caches = [(torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD_DIM).bfloat16(),
               torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD_DIM).bfloat16()) for _ in range(30)]
    tables = torch.randperm(num_blocks)[: seqs * blocks].view(seqs, blocks).tolist()
    slots = [t[(length - 1) // BLOCK] * BLOCK + (length - 1) % BLOCK for t in tables]
    meta = AttentionMetadata.build(slots, list(range(seqs + 1)), [length] * seqs, tables, BLOCK)
    batch = meta.decode_batch()
    query = torch.randn(seqs, HEADS, HEAD_DIM).bfloat16()

    def kernel():
        for k, v in caches:
            ops.paged_decode_attention(query, k, v, batch.block_tables, batch.seq_lens, SCALE)

    def gather():
        for k, v in caches:
            torch_backend._decode(query, k, v, batch)

    return ms_per_call(gather), ms_per_call(kernel)


def prefill_case(ops, length: int) -> tuple[float, float]:
    blocks = -(-length // BLOCK)
    k_cache = torch.randn(blocks + 4, BLOCK, KV_HEADS, HEAD_DIM).bfloat16()
    v_cache = torch.randn_like(k_cache)
    table = torch.randperm(blocks + 4)[:blocks]
    query = torch.randn(length, HEADS, HEAD_DIM).bfloat16()
    group = HEADS // KV_HEADS

    def sdpa():
        keys = k_cache[table].flatten(0, 1)[:length].transpose(0, 1).repeat_interleave(group, 0)
        values = v_cache[table].flatten(0, 1)[:length].transpose(0, 1).repeat_interleave(group, 0)
        return F.scaled_dot_product_attention(query.transpose(0, 1).unsqueeze(0), keys.unsqueeze(0),
                                              values.unsqueeze(0), is_causal=True, scale=SCALE)

    def kernel():
        return ops.paged_prefill_attention(query, k_cache, v_cache, table, 0, SCALE)

    return ms_per_call(sdpa, 20), ms_per_call(kernel, 20)


def main() -> None:
    args = parse_args()
    ops = kernel_ops()
    assert ops is not None, "the C++ kernels did not build (make install builds them)"
    torch_backend = BatchedBackend(HEADS, KV_HEADS, HEAD_DIM, use_kernel=False)
    print(f"threads={args.threads}, bfloat16, {HEADS} heads / {KV_HEADS} KV heads, head_dim {HEAD_DIM}")
    print("decode, 30 layers:   torch gather ms   C++ ms   speed-up")
    for seqs, length in ((1, 600), (8, 600), (16, 600), (16, 1500)):
        base, ours = decode_case(ops, torch_backend, seqs, length)
        print(f"  S={seqs:>2} L={length:>4}      {base:9.2f}   {ours:8.2f}   {base / ours:6.2f}x")
    print("prefill, one layer:  SDPA ms           C++ ms   speed-up")
    for length in (256, 450, 768):
        base, ours = prefill_case(ops, length)
        print(f"  L={length:>4}             {base:9.2f}   {ours:8.2f}   {base / ours:6.2f}x")


if __name__ == "__main__":
    main()
