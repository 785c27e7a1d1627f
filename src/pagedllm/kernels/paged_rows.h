// Walking one KV head's rows in the paged cache, block by block, with the blocks ahead
// prefetched: shared by the decode / per-token attention (paged_attention.cpp) and its q.k
// score functions (attention_scores.h).
#pragma once
#include <algorithm>
#include <cstdint>

#include "dtype.h"
#include "paged_cache.h"

using pagedllm::Cvt;

template <typename scalar_t, int D>
static inline void load_row(const scalar_t* __restrict__ src, float* __restrict__ dst) {
  for (int d = 0; d < D; ++d) dst[d] = Cvt<scalar_t>::load(src, d);
}

// An int8 row's codes as floats; its scale is applied by the caller, once per row.
template <typename scalar_t, int D>
static inline void load_row(const int8_t* __restrict__ src, float* __restrict__ dst) {
  for (int d = 0; d < D; ++d) dst[d] = static_cast<float>(src[d]);
}

// Asks for the rows of one KV head a few blocks ahead while this block is computed: blocks
// are scattered, so the hardware prefetcher cannot guess them (benchmarks/attention_kernels.py:
// K/V come from memory, not cache). Into L2 (prefetcht1), not L1: a block of one head is 16
// rows a token stride apart, 32 lines or more at once, and on Intel's cores a prefetch into
// L1 holds one of the few L1 miss buffers until memory answers (as for the low-bit GEMMs:
// lowbit_gemm.h). BENCHMARKS.md has the figures.
constexpr int64_t kPrefetchAhead = 2;

template <typename cache_t>
static inline void prefetch_block(const cache_t* block, int64_t block_size, int64_t token_stride,
                                  int64_t head_dim) {
  const char* base = reinterpret_cast<const char*>(block);
  const int64_t row_bytes = head_dim * static_cast<int64_t>(sizeof(cache_t));
  for (int64_t r = 0; r < block_size; ++r)
    for (int64_t c = 0; c < row_bytes; c += 64)
      __builtin_prefetch(base + (r * token_stride) * static_cast<int64_t>(sizeof(cache_t)) + c, 0, 2);
}

// Walks one KV head's context, positions first .. len - 1, block by block: fn(rows, scales,
// index, n) gets the first row of the block's part in the context (the next rows
// token_stride apart), its scales (kv_heads apart; null when not quantized), that row's
// index counted from `first`, and how many rows follow, while the rows kPrefetchAhead
// blocks ahead are asked for. first > 0 for a sliding window: the blocks before it may be
// back in the pool already, and are never read.
template <typename cache_t, typename Fn>
static inline void for_each_block(const HeadRows<cache_t>& h, const int64_t* table, int64_t first,
                                  int64_t len, int64_t head_dim, const Fn& fn) {
  const int64_t block_stride = h.block_size * h.token_stride;
  const int64_t scale_stride = h.block_size * h.kv_heads;
  for (int64_t b = first / h.block_size, pos = first; pos < len; ++b) {
    const int64_t block_start = b * h.block_size, skip = pos - block_start;
    if (block_start + kPrefetchAhead * h.block_size < len) {
      const int64_t ahead = table[b + kPrefetchAhead];
      prefetch_block(h.cache + ahead * block_stride, h.block_size, h.token_stride, head_dim);
      if (h.scales)
        for (int64_t c = 0; c < scale_stride; c += 16) __builtin_prefetch(h.scales + ahead * scale_stride + c);
    }
    const int64_t n = std::min(h.block_size, len - block_start) - skip;
    fn(h.cache + table[b] * block_stride + skip * h.token_stride,
       h.scales ? h.scales + table[b] * scale_stride + skip * h.kv_heads : nullptr, pos - first, n);
    pos += n;
  }
}
