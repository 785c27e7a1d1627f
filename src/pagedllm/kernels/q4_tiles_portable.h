// The 4-bit tiles in plain C++ (the portable build: any x86-64, aarch64). Each group's codes
// are first unpacked to an input-major [32][16] array, so that the inner loops run over the
// tile's 16 output rows with no dependence between them: the compiler turns them into
// vector multiply-adds of whatever width the target has.
#pragma once
#include "q4_layout.h"

namespace pagedllm::q4 {

// Activation codes in natural order: the portable tile unpacks weights to that order.
constexpr bool kInterleavedCodes = false;

// The exact tile reads activations widened to float32 once per call (q4_gemm does it).
using ExactInput = float;

// One group of a tile: codes[k][i] = the code of input k for output row i, d and m per row.
struct UnpackedGroup {
  alignas(64) uint8_t codes[kGroup][kTile];
  alignas(64) float d[kTile], m[kTile];
  explicit UnpackedGroup(const uint8_t* block) {
    for (int j = 0; j < 4; ++j)
      for (int i = 0; i < kTile; ++i) {
        uint32_t lane;
        std::memcpy(&lane, block + 64 * j + 4 * i, 4);
        for (int c = 0; c < 8; ++c) codes[8 * j + c][i] = (lane >> code_shift(c)) & 0xF;
      }
    const auto* halves = reinterpret_cast<const at::Half*>(block + kCodeBytes);
    for (int i = 0; i < kTile; ++i) d[i] = static_cast<float>(halves[i]), m[i] = static_cast<float>(halves[kTile + i]);
  }
};

inline void store_row(const float* total, at::BFloat16* out) {
  for (int i = 0; i < kTile; ++i) out[i] = c10::BFloat16(total[i]);  // round to nearest even
}

// R bfloat16 rows times one tile, exactly: x . q in float32 (products of a bfloat16 and a
// 4-bit integer are exact), then d * (x . q) + m * sum(x) per group.
template <int R>
void tile_rows(const uint8_t* tile, int64_t groups, const float* x, int64_t ldx,
               const float* xsum, at::BFloat16* out, int64_t ldo) {
  alignas(64) float total[R][kTile] = {};
  for (int64_t g = 0; g < groups; ++g) {
    const UnpackedGroup w(tile + g * kBlockBytes);
    for (int r = 0; r < R; ++r) {
      alignas(64) float acc[kTile] = {};
      const float* xr = x + r * ldx + g * kGroup;
      for (int k = 0; k < kGroup; ++k) {
        const float xv = xr[k];
        for (int i = 0; i < kTile; ++i) acc[i] += xv * static_cast<float>(w.codes[k][i]);
      }
      const float s = xsum[r * groups + g];
      for (int i = 0; i < kTile; ++i) total[r][i] += w.d[i] * acc[i] + w.m[i] * s;
    }
  }
  for (int r = 0; r < R; ++r) store_row(total[r], out + r * ldo);
}

// R rows of int8 activations (quantize_rows<false>) times one tile: exact int32 sums per
// group, sum x*w = dx * (d * (xq . q) + m * sum(xq)).
template <int R>
void tile_rows_int8(const uint8_t* tile, int64_t groups, const int8_t* xq, int64_t ldx,
                    const float* dx, const float* dx_sum, at::BFloat16* out, int64_t ldo) {
  alignas(64) float total[R][kTile] = {};
  for (int64_t g = 0; g < groups; ++g) {
    const UnpackedGroup w(tile + g * kBlockBytes);
    for (int r = 0; r < R; ++r) {
      alignas(64) int32_t acc[kTile] = {};
      const int8_t* xr = xq + r * ldx + g * kGroup;
      for (int k = 0; k < kGroup; ++k) {
        const int32_t xv = xr[k];
        for (int i = 0; i < kTile; ++i) acc[i] += xv * static_cast<int32_t>(w.codes[k][i]);
      }
      const float scale = dx[r * groups + g], shift = dx_sum[r * groups + g];
      for (int i = 0; i < kTile; ++i)
        total[r][i] += static_cast<float>(acc[i]) * (w.d[i] * scale) + w.m[i] * shift;
    }
  }
  for (int r = 0; r < R; ++r) store_row(total[r], out + r * ldo);
}

}  // namespace pagedllm::q4
