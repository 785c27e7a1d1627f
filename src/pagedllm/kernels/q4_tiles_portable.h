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
template <class L>
struct UnpackedGroup {
  alignas(64) uint8_t codes[kGroup][kTile];
  alignas(64) float d[kTile], m[kTile];
  UnpackedGroup(const uint8_t* tile, int64_t g) {
    const uint8_t* block = group_codes<L>(tile, g);
    for (int j = 0; j < 4; ++j)
      for (int i = 0; i < kTile; ++i) {
        uint32_t lane;
        std::memcpy(&lane, block + 64 * j + 4 * i, 4);
        for (int c = 0; c < 8; ++c) codes[8 * j + c][i] = (lane >> code_shift(c)) & 0xF;
      }
    const uint8_t* scales = tile + g / L::kGroupsPerBlock * L::kBlockBytes;
    if constexpr (L::kGroupsPerBlock == 1) {
      const auto* halves = reinterpret_cast<const pagedllm::f16*>(scales + kCodeBytes);
      for (int i = 0; i < kTile; ++i) d[i] = static_cast<float>(halves[i]), m[i] = static_cast<float>(halves[kTile + i]);
    } else {
      const int64_t j = g % L::kGroupsPerBlock;
      const auto* dd = reinterpret_cast<const pagedllm::f16*>(scales + L::kDOffset);
      const auto* dm = reinterpret_cast<const pagedllm::f16*>(scales + L::kDminOffset);
      for (int i = 0; i < kTile; ++i) {
        d[i] = static_cast<float>(dd[i]) * scales[L::kScaleOffset + kTile * j + i];
        m[i] = static_cast<float>(dm[i]) * scales[L::kMinOffset + kTile * j + i];
      }
    }
  }
};

inline void store_row(const float* total, pagedllm::bf16* out) {
  for (int i = 0; i < kTile; ++i) out[i] = pagedllm::bf16(total[i]);  // round to nearest even
}

// R activation rows (X: float32 values, or int8 codes) times one tile. Per group, x . q is
// summed exactly in Acc (float32: a bfloat16 value times a 4-bit integer is exact; int32 for
// codes), then total += (x . q) * d * scale + m * shift, where scale and shift are per row
// and group: 1 and sum(x) for exact rows, dx and dx * sum(xq) for int8 rows.
// The build's -ffast-math lets the compiler regroup `total + a * b + c * e` differently in
// each instantiation of R, and then a row's result would depend on how many rows came with
// it; speculative decoding needs a row computed alone and in a block to agree bit for bit
// (engine/model_runner.py). Every loop here vectorises over independent output rows, so
// keeping the written order costs nothing.
#if defined(__clang__)
#define PAGEDLLM_WRITTEN_ORDER _Pragma("clang fp reassociate(off)")
#define PAGEDLLM_WRITTEN_ORDER_FN
#else
#define PAGEDLLM_WRITTEN_ORDER
#define PAGEDLLM_WRITTEN_ORDER_FN __attribute__((optimize("no-associative-math")))
#endif

template <class L, int R, typename X, typename Acc>
PAGEDLLM_WRITTEN_ORDER_FN void tile_rows_of(const uint8_t* tile, int64_t groups, const X* x, int64_t ldx,
                  const float* scale, const float* shift, pagedllm::bf16* out, int64_t ldo) {
  PAGEDLLM_WRITTEN_ORDER
  alignas(64) float total[R][kTile] = {};
  for (int64_t g = 0; g < groups; ++g) {
    const UnpackedGroup<L> w(tile, g);
    for (int r = 0; r < R; ++r) {
      alignas(64) Acc acc[kTile] = {};
      const X* xr = x + r * ldx + g * kGroup;
      for (int k = 0; k < kGroup; ++k) {
        const Acc xv = xr[k];
        for (int i = 0; i < kTile; ++i) acc[i] += xv * static_cast<Acc>(w.codes[k][i]);
      }
      const float s = scale ? scale[r * groups + g] : 1.0f, m = shift[r * groups + g];
      for (int i = 0; i < kTile; ++i) total[r][i] += static_cast<float>(acc[i]) * (w.d[i] * s) + w.m[i] * m;
    }
  }
  for (int r = 0; r < R; ++r) store_row(total[r], out + r * ldo);
}

// Exact rows: x widened to float32 (q4_gemm), xsum = sum(x) per row and group.
template <class L, int R>
void tile_rows(const uint8_t* tile, int64_t groups, const float* x, int64_t ldx,
               const float* xsum, pagedllm::bf16* out, int64_t ldo) {
  tile_rows_of<L, R, float, float>(tile, groups, x, ldx, nullptr, xsum, out, ldo);
}

// Int8 rows (quantize_rows<false>): dx per row and group, dx_sum = dx * sum(xq).
template <class L, int R>
void tile_rows_int8(const uint8_t* tile, int64_t groups, const int8_t* xq, int64_t ldx,
                    const float* dx, const float* dx_sum, const int32_t* /*sum_pairs*/, pagedllm::bf16* out,
                    int64_t ldo) {
  tile_rows_of<L, R, int8_t, int32_t>(tile, groups, xq, ldx, dx, dx_sum, out, ldo);
}

}  // namespace pagedllm::q4
