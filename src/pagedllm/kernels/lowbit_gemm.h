// Pieces shared by the low-bit GEMMs (q4_gemm.cpp, q8_gemm.cpp): weights repacked into tiles
// of 16 output rows x 32 inputs (one scale group), multiplied with AVX512-BF16 pair dot
// products by a few bfloat16 activation rows at a time.
#pragma once
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace pagedllm::lowbit {

constexpr int64_t kGroup = 32;  // inputs per scale group (GGUF's block)
constexpr int64_t kTile = 16;   // output rows per tile: one float32 vector
constexpr int kRowBlock = 8;    // activation rows per pass over a tile: 2 x 8 accumulator chains
// How far ahead (in tile blocks) the codes are asked for: the hardware prefetcher alone left
// q4_gemm waiting on memory (8 rows, 30 layers: 3.3 ms without, 2.5 ms 16 blocks ahead).
constexpr int64_t kPrefetchBlocks = 16;

inline bool available() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

inline void prefetch_ahead(const uint8_t* block, int64_t block_bytes) {
  const uint8_t* ahead = block + kPrefetchBlocks * block_bytes;
  for (int64_t line = 0; line < block_bytes; line += 64) __builtin_prefetch(ahead + line);
}

#if defined(__AVX512BF16__)
// x[k], x[k + 1] in every 32-bit lane: the activation side of a pair dot product.
inline __m512bh broadcast_pair(const at::BFloat16* x) {
  int32_t pair;
  std::memcpy(&pair, x, 4);
  return (__m512bh)_mm512_set1_epi32(pair);
}
#endif

// Calls tile(t, r0, rows) for every tile of output rows and block of up to kRowBlock
// activation rows; tiles are split between threads.
template <typename Fn>
void for_each_tile(int64_t tiles, int64_t rows, const Fn& tile) {
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t r0 = 0; r0 < rows; r0 += kRowBlock)
        tile(t, r0, static_cast<int>(std::min<int64_t>(kRowBlock, rows - r0)));
  });
}

}  // namespace pagedllm::lowbit
