// Pieces shared by the low-bit GEMMs (q4_gemm.cpp, q8_gemm.cpp): weights repacked into tiles
// of 16 output rows x 32 inputs (one scale group), multiplied with AVX512-BF16 pair dot
// products by a few bfloat16 activation rows at a time.
#pragma once
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <cstring>

#if defined(__AVX512F__)
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

// By the bits: the kernels build with -ffast-math, under which std::isfinite may fold to true.
inline bool is_finite(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, 4);
  return (bits & 0x7F800000u) != 0x7F800000u;
}

inline void prefetch_ahead(const uint8_t* block, int64_t block_bytes) {
  const uint8_t* ahead = block + kPrefetchBlocks * block_bytes;
  for (int64_t line = 0; line < block_bytes; line += 64) __builtin_prefetch(ahead + line);
}

#if defined(__AVX512F__)
// 16 float16 values (a tile's scales, as GGUF stores them) as float32.
inline __m512 load_halves(const uint8_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
#endif

#if defined(__AVX512BF16__)
// x[k], x[k + 1] in every 32-bit lane: the activation side of a pair dot product.
inline __m512bh broadcast_pair(const at::BFloat16* x) {
  int32_t pair;
  std::memcpy(&pair, x, 4);
  return (__m512bh)_mm512_set1_epi32(pair);
}
#endif

// Checks a weight to pack: codes [N, K] of the given dtype, N a whole number of tiles, K of
// groups. Returns the number of groups.
inline int64_t check_pack(const torch::Tensor& codes, at::ScalarType dtype, const char* dtype_name) {
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == dtype, "codes must be [N, K] ", dtype_name);
  TORCH_CHECK(codes.size(0) % kTile == 0, "output rows must be a multiple of ", kTile, ", got ", codes.size(0));
  TORCH_CHECK(codes.size(1) % kGroup == 0, "inputs must be a multiple of ", kGroup, ", got ", codes.size(1));
  return codes.size(1) / kGroup;
}

struct GemmShape {
  int64_t rows, k, tiles, groups;
};

// Checks x [M, K] bfloat16 against a packed weight [N / 16, K / 32, block_bytes].
inline GemmShape check_gemm(const torch::Tensor& x, const torch::Tensor& packed, int64_t block_bytes,
                            const char* pack_fn) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "x must be [M, K] bfloat16");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kByte && packed.size(2) == block_bytes,
              "packed must come from ", pack_fn);
  const GemmShape s{x.size(0), x.size(1), packed.size(0), packed.size(1)};
  TORCH_CHECK(s.k == s.groups * kGroup, "x has ", s.k, " inputs, the weight ", s.groups * kGroup);
  return s;
}

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
