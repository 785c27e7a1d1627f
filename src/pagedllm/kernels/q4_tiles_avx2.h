// The 4-bit tiles with AVX2 intrinsics (the avx2 build: AVX2 + FMA + F16C). A 64-byte code
// vector of the packed layout is two 256-bit halves, output rows 0-7 and 8-15.
// - Exact tile (q4_gemm): each code pulled out of its lane by a shift and a mask, converted
//   to float32 and multiplied with float32 FMAs (a bfloat16 times a 4-bit integer is exact):
//   four instructions a code, so served only where PAGEDLLM_CPU_INT16=0 asks for it.
// - Int16 tile (q4_i16_gemm, the exact product this level serves: kernels/cpu.py): the
//   activations as 16-bit integers in two int8 halves, each half through the int8 tile's
//   vpmaddubsw, recombined exactly per group (see tile_rows_int16).
// - Int8 tile (q4_q8_gemm): as llama.cpp multiplies Q4 by Q8 on AVX2: the low and high
//   nibbles of each byte, as unsigned bytes, times the interleaved int8 activation codes with
//   vpmaddubsw (pairs summed to int16: at most 2 x 15 x 127 = 3810, so the 8 of a group sum to
//   at most 30480 and never saturate), then vpmaddwd against ones to int32 and the scales in
//   float32, once per group (Q4_0, Q4_1); for Q4_K, against the group's 6-bit scales, and the
//   float32 work once per 256 inputs (super_rows_int8).
#pragma once
#include "q4_layout.h"

namespace pagedllm::q4 {

// quantize_rows stores each 8 activation codes in the order the int8 tile reads nibbles.
constexpr bool kInterleavedCodes = true;

// 8 float16 values (half a tile's scales) as float32.
inline __m256 load_halves8(const uint8_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// 8 bytes (half a group's 6-bit scales or mins of the tile's rows) as float32.
inline __m256 load_bytes8(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// Group g's d and m for the tile's rows 8h..8h+7: w = d * q + m.
template <class L>
inline void group_scales(const uint8_t* tile, int64_t g, int h, __m256& d, __m256& m) {
  const uint8_t* block = tile + g / L::kGroupsPerBlock * L::kBlockBytes;
  if constexpr (L::kGroupsPerBlock == 1) {
    d = load_halves8(block + kCodeBytes + 16 * h);
    m = load_halves8(block + kCodeBytes + 32 + 16 * h);
  } else {
    const int64_t j = g % L::kGroupsPerBlock;
    d = _mm256_mul_ps(load_halves8(block + L::kDOffset + 16 * h),
                      load_bytes8(block + L::kScaleOffset + kTile * j + 8 * h));
    m = _mm256_mul_ps(load_halves8(block + L::kDminOffset + 16 * h),
                      load_bytes8(block + L::kMinOffset + kTile * j + 8 * h));
  }
}

// The exact tile reads activations widened to float32 once per call (q4_gemm does it), so
// each one reaches the FMAs as a broadcast straight from memory, with no ALU work.
using ExactInput = float;

// 8 float32 totals rounded to bfloat16 (nearest even) and stored.
inline void store_bf16x8(const __m256 v, pagedllm::bf16* out) {
  __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  u = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  // Pack the 8 low halves: packus works within 128-bit lanes, then order the two quads.
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(u, u), 0xD8);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm256_castsi256_si128(packed));
}

template <int C>
inline __m256 code_floats(__m256i v) {
  return _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(v, code_shift(C)), _mm256_set1_epi32(0xF)));
}

template <int R, int C>
inline void fma_code(__m256 (&acc)[2][R], const __m256i (&v)[2], const float* x,
                     int64_t ldx, int64_t k) {
  const __m256 w0 = code_floats<C>(v[0]), w1 = code_floats<C>(v[1]);
  for (int r = 0; r < R; ++r) {
    const __m256 xv = _mm256_broadcast_ss(x + r * ldx + k + C);
    acc[0][r] = _mm256_fmadd_ps(w0, xv, acc[0][r]);
    acc[1][r] = _mm256_fmadd_ps(w1, xv, acc[1][r]);
  }
}

// R rows (bfloat16 values widened to float32) times one tile, exactly:
// d * (x . q) + m * sum(x) per group.
template <class L, int R>
void tile_rows(const uint8_t* tile, int64_t groups, const float* x, int64_t ldx,
               const float* xsum, pagedllm::bf16* out, int64_t ldo) {
  // The float32 totals live in memory, touched once per group, so the registers go to the
  // accumulators.
  alignas(32) float total[R][kTile] = {};
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* block = group_codes<L>(tile, g);
    prefetch_group<L>(tile, g);
    __m256 acc[2][R];
    for (int h = 0; h < 2; ++h)
      for (int r = 0; r < R; ++r) acc[h][r] = _mm256_setzero_ps();
    for (int j = 0; j < 4; ++j) {
      const __m256i v[2] = {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 64 * j)),
                            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 64 * j + 32))};
      const int64_t k = g * kGroup + 8 * j;
      fma_code<R, 0>(acc, v, x, ldx, k);
      fma_code<R, 1>(acc, v, x, ldx, k);
      fma_code<R, 2>(acc, v, x, ldx, k);
      fma_code<R, 3>(acc, v, x, ldx, k);
      fma_code<R, 4>(acc, v, x, ldx, k);
      fma_code<R, 5>(acc, v, x, ldx, k);
      fma_code<R, 6>(acc, v, x, ldx, k);
      fma_code<R, 7>(acc, v, x, ldx, k);
    }
    for (int h = 0; h < 2; ++h) {
      __m256 d, m;
      group_scales<L>(tile, g, h, d, m);
      for (int r = 0; r < R; ++r) {
        const __m256 t = _mm256_fmadd_ps(acc[h][r], d, _mm256_load_ps(total[r] + 8 * h));
        _mm256_store_ps(total[r] + 8 * h, _mm256_fmadd_ps(m, _mm256_set1_ps(xsum[r * groups + g]), t));
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < 2; ++h) store_bf16x8(_mm256_load_ps(total[r] + 8 * h), out + r * ldo + 8 * h);
}

// 4 int8 activation codes in every 32-bit lane.
inline __m256i broadcast_quad8(const int8_t* x) {
  int32_t quad;
  std::memcpy(&quad, x, 4);
  return _mm256_set1_epi32(quad);
}

// x . q over 8 inputs (low nibbles times the codes at x, high nibbles times those at x + 4)
// for the 8 rows of one half of a code vector: int16 pairs, within the ranges the callers
// state (vpmaddubsw saturates, so each caller bounds its sums).
inline __m256i dot8(__m256i low, __m256i high, const int8_t* x) {
  return _mm256_add_epi16(_mm256_maddubs_epi16(low, broadcast_quad8(x)),
                          _mm256_maddubs_epi16(high, broadcast_quad8(x + 4)));
}

// The int8 tile takes rows in passes of 4, each with both halves of the tile (8 output rows
// each) at once: every activation broadcast serves both halves, the codes are unpacked once
// per pass, and the 8 chains stay in registers. More rows split into passes that read the
// tile again from cache (rows are independent, so each row's result is the same as when
// alone). One pass over 8 rows, a half at a time, was slower (docs/benchmarks/log.md,
// 2026-12-07).
constexpr int kInt8RowsPerPass = 4;

// The int16 tile's halves (8 output rows each) taken in one pass over a group: both where
// the rows are few (their int16 chains fit the 16 registers twice over), one half at a time
// where they are many, so that R rows' chains stay in registers instead of spilling. The
// codes of a half are unpacked once per pass and serve all R rows. (Passes of 2 rows with
// both halves, as the int8 tile's, were slower on the default model's shapes.)
template <int R, int kChainsPerRow>
constexpr int kHalvesPerPass = R * kChainsPerRow <= 4 ? 2 : 1;

// x . q over one group for R rows and both halves of the tile (int16 pairs: a group's sums are
// at most 8 x 2 x 15 x 127 = 30480, no saturation), for super_rows_int8. Per code vector both
// halves are unpacked first, then each row's two activation broadcasts serve all four
// products: with the halves outermost, GCC kept every row's broadcasts live across both and
// spilled the chains there.
template <int R>
inline void group_dots(const uint8_t* block, const int8_t* xq, int64_t ldx, __m256i (&sum16)[2][R]) {
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  for (int h = 0; h < 2; ++h)
    for (int r = 0; r < R; ++r) sum16[h][r] = _mm256_setzero_si256();
  for (int j = 0; j < 4; ++j) {
    __m256i low[2], high[2];
    for (int h = 0; h < 2; ++h) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 64 * j + 32 * h));
      low[h] = _mm256_and_si256(v, nibble);
      high[h] = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
    }
    for (int r = 0; r < R; ++r) {
      const int8_t* x = xq + r * ldx + 8 * j;
      const __m256i x0 = broadcast_quad8(x), x1 = broadcast_quad8(x + 4);
      for (int h = 0; h < 2; ++h) {
        sum16[h][r] = _mm256_add_epi16(sum16[h][r], _mm256_add_epi16(_mm256_maddubs_epi16(low[h], x0),
                                                                    _mm256_maddubs_epi16(high[h], x1)));
        in_register(sum16[h][r]);
      }
    }
  }
}

// R rows of int8 activations (quantize_rows<true>, one scale per group) times one GroupLayout
// tile: sum x*w = dx * (d * (xq . q) + m * sum(xq)) per group, the dot product exact in
// integers.
template <class L, int R>
void group_rows_int8(const uint8_t* tile, int64_t groups, const int8_t* xq, int64_t ldx,
                     const float* dx, const float* dx_sum, pagedllm::bf16* out, int64_t ldo) {
  // The float32 totals live in memory, touched once per group, so the registers go to the
  // chains.
  alignas(32) float total[R][kTile] = {};
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* block = group_codes<L>(tile, g);
    prefetch_group<L>(tile, g);
    // Halves outermost here (group_dots' order measured ~4 % slower with this epilogue:
    // benchmarks/kernel_builds.py).
    __m256i sum16[2][R];
    for (int h = 0; h < 2; ++h)
      for (int r = 0; r < R; ++r) sum16[h][r] = _mm256_setzero_si256();
    for (int j = 0; j < 4; ++j)
      for (int h = 0; h < 2; ++h) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 64 * j + 32 * h));
        const __m256i low = _mm256_and_si256(v, nibble);
        const __m256i high = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
        for (int r = 0; r < R; ++r) {
          sum16[h][r] = _mm256_add_epi16(sum16[h][r], dot8(low, high, xq + r * ldx + g * kGroup + 8 * j));
          in_register(sum16[h][r]);
        }
      }
    for (int h = 0; h < 2; ++h) {
      __m256 d, m;
      group_scales<L>(tile, g, h, d, m);
      for (int r = 0; r < R; ++r) {
        float* t8 = total[r] + 8 * h;
        const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(sum16[h][r], ones));
        const __m256 scale = _mm256_mul_ps(d, _mm256_set1_ps(dx[r * groups + g]));
        const __m256 t = _mm256_fmadd_ps(dot, scale, _mm256_load_ps(t8));
        _mm256_store_ps(t8, _mm256_fmadd_ps(m, _mm256_set1_ps(dx_sum[r * groups + g]), t));
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < 2; ++h) store_bf16x8(_mm256_load_ps(total[r] + 8 * h), out + r * ldo + 8 * h);
}

// The same for a SuperLayout (Q4_K) tile, whose rows' activations share one scale per block
// of 256 inputs (quantize_rows with 8 groups a scale, as llama.cpp's Q8_K): the 6-bit scales
// and mins are folded in integers, so the float work is once per block, not once per group,
// where it was a third of the tile's instructions:
//   sum x*w = dx * (d * sum_j sc_j (xq . q)_j + dmin * sum_j mn_j sum(xq)_j) per block.
// Each group's int16 sums go through vpmaddwd against its scales (at most 63 x 2 x 30480 a
// group: a block's 8 stay below 2^25); the mins meet sum_pairs, two groups' code sums (at
// most 32 x 127 each) as the int16 halves of one int32.
template <class L, int R>
void super_rows_int8(const uint8_t* tile, int64_t groups, const int8_t* xq, int64_t ldx,
                     const float* dx, const int32_t* sum_pairs, pagedllm::bf16* out, int64_t ldo) {
  constexpr int64_t G = L::kGroupsPerBlock;
  alignas(32) float total[R][kTile] = {};
  for (int64_t b = 0; b < groups / G; ++b) {
    const uint8_t* block = tile + b * L::kBlockBytes;
    // The block's int32 sums live in memory (one add a group), as the totals do.
    alignas(32) int32_t acc[R][kTile] = {};
    for (int64_t j = 0; j < G; ++j) {
      const int64_t g = b * G + j;
      prefetch_group<L>(tile, g);
      __m256i sum16[2][R];
      group_dots<R>(block + j * kCodeBytes, xq + g * kGroup, ldx, sum16);
      for (int h = 0; h < 2; ++h) {
        // Row i's scale in both int16 halves of lane i.
        const __m128i sc8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(block + L::kScaleOffset + kTile * j + 8 * h));
        const __m256i sc = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(sc8, sc8));
        for (int r = 0; r < R; ++r) {
          __m256i* a = reinterpret_cast<__m256i*>(acc[r] + 8 * h);
          _mm256_store_si256(a, _mm256_add_epi32(_mm256_load_si256(a), _mm256_madd_epi16(sum16[h][r], sc)));
        }
      }
    }
    for (int h = 0; h < 2; ++h) {
      // Row i's mins of groups 2p and 2p + 1 as the int16 halves of lane i.
      __m256i mn[G / 2];
      for (int64_t p = 0; p < G / 2; ++p) {
        const uint8_t* m0 = block + L::kMinOffset + kTile * 2 * p + 8 * h;
        mn[p] = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(m0)),
                                                       _mm_loadl_epi64(reinterpret_cast<const __m128i*>(m0 + kTile))));
      }
      const __m256 d = load_halves8(block + L::kDOffset + 16 * h);
      const __m256 dmin = load_halves8(block + L::kDminOffset + 16 * h);
      for (int r = 0; r < R; ++r) {
        const int32_t* pairs = sum_pairs + (r * groups + b * G) / 2;
        __m256i mins = _mm256_madd_epi16(mn[0], _mm256_set1_epi32(pairs[0]));
        for (int64_t p = 1; p < G / 2; ++p)
          mins = _mm256_add_epi32(mins, _mm256_madd_epi16(mn[p], _mm256_set1_epi32(pairs[p])));
        const __m256 dxv = _mm256_set1_ps(dx[r * groups + b * G]);
        float* t8 = total[r] + 8 * h;
        const __m256 dot = _mm256_cvtepi32_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(acc[r] + 8 * h)));
        const __m256 t = _mm256_fmadd_ps(dot, _mm256_mul_ps(d, dxv), _mm256_load_ps(t8));
        _mm256_store_ps(t8, _mm256_fmadd_ps(_mm256_cvtepi32_ps(mins), _mm256_mul_ps(dmin, dxv), t));
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < 2; ++h) store_bf16x8(_mm256_load_ps(total[r] + 8 * h), out + r * ldo + 8 * h);
}

// R rows of int8 activations (quantize_rows<true>) times one tile, in passes of
// kInt8RowsPerPass rows. sum_pairs: SuperLayout only (int8_gemm fills it for Q4_K).
template <class L, int R>
void tile_rows_int8(const uint8_t* tile, int64_t groups, const int8_t* xq, int64_t ldx, const float* dx,
                    const float* dx_sum, const int32_t* sum_pairs, pagedllm::bf16* out, int64_t ldo) {
  constexpr int P = kInt8RowsPerPass;
  if constexpr (R > P) {
    tile_rows_int8<L, P>(tile, groups, xq, ldx, dx, dx_sum, sum_pairs, out, ldo);
    tile_rows_int8<L, R - P>(tile, groups, xq + P * ldx, ldx, dx + P * groups, dx_sum + P * groups,
                             sum_pairs ? sum_pairs + P * groups / 2 : nullptr, out + P * ldo, ldo);
  } else if constexpr (L::kGroupsPerBlock > 1) {
    super_rows_int8<L, R>(tile, groups, xq, ldx, dx, sum_pairs, out, ldo);
  } else {
    group_rows_int8<L, R>(tile, groups, xq, ldx, dx, dx_sum, out, ldo);
  }
}

// The exact few-row product at this level (kernels/cpu.py chooses it over tile_rows, whose
// float32 FMAs take four instructions a code): R rows of activations as 16-bit integers in
// two int8 halves (split_rows), each half through vpmaddubsw as the int8 tile's codes, then
// recombined exactly per group: sum x*w = dx * (d * (256 * (hi . q) + lo . q) + m * sum(xi)).
// The int16 chains stay below saturation: hi is within -64..64, so its group sum is at most
// 8 x 2 x 15 x 64 = 15360; lo within -128..127, at most 30720. vpmaddwd then widens hi
// against 256 and lo against 1 (products below 2^22: exact in int32).
#define PAGEDLLM_INT16_TILES 1
template <class L, int R>
void tile_rows_int16(const uint8_t* tile, int64_t groups, const int8_t* xh, const int8_t* xl,
                     int64_t ldx, const float* dx, const float* dx_sum, pagedllm::bf16* out, int64_t ldo) {
  if constexpr (R > 4) {
    // Two chains a row: more than 4 rows would spill; the second pass reads the tile from
    // cache. Rows are independent, so each row's result is the same as when alone.
    tile_rows_int16<L, 4>(tile, groups, xh, xl, ldx, dx, dx_sum, out, ldo);
    tile_rows_int16<L, R - 4>(tile, groups, xh + 4 * ldx, xl + 4 * ldx, ldx, dx + 4 * groups,
                              dx_sum + 4 * groups, out + 4 * ldo, ldo);
  } else {
    constexpr int H = kHalvesPerPass<R, 2>;
    alignas(32) float total[R][kTile] = {};
    const __m256i nibble = _mm256_set1_epi8(0x0F);
    const __m256i ones = _mm256_set1_epi16(1);
    const __m256i shift8 = _mm256_set1_epi16(256);
    for (int h0 = 0; h0 < 2; h0 += H) {
      for (int64_t g = 0; g < groups; ++g) {
        const uint8_t* block = group_codes<L>(tile, g);
        prefetch_group<L>(tile, g);
        __m256i hi[H][R], lo[H][R];
        for (int h = 0; h < H; ++h)
          for (int r = 0; r < R; ++r) hi[h][r] = lo[h][r] = _mm256_setzero_si256();
        for (int j = 0; j < 4; ++j)
          for (int h = 0; h < H; ++h) {
            const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 64 * j + 32 * (h0 + h)));
            const __m256i low = _mm256_and_si256(v, nibble);
            const __m256i high = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
            for (int r = 0; r < R; ++r) {
              const int64_t at = r * ldx + g * kGroup + 8 * j;
              hi[h][r] = _mm256_add_epi16(hi[h][r], dot8(low, high, xh + at));
              lo[h][r] = _mm256_add_epi16(lo[h][r], dot8(low, high, xl + at));
              in_register(hi[h][r]);
              in_register(lo[h][r]);
            }
          }
        for (int h = 0; h < H; ++h) {
          __m256 d, m;
          group_scales<L>(tile, g, h0 + h, d, m);
          for (int r = 0; r < R; ++r) {
            float* t8 = total[r] + 8 * (h0 + h);
            const __m256i sum = _mm256_add_epi32(_mm256_madd_epi16(hi[h][r], shift8),
                                                 _mm256_madd_epi16(lo[h][r], ones));
            const __m256 scale = _mm256_mul_ps(d, _mm256_set1_ps(dx[r * groups + g]));
            const __m256 t = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), scale, _mm256_load_ps(t8));
            _mm256_store_ps(t8, _mm256_fmadd_ps(m, _mm256_set1_ps(dx_sum[r * groups + g]), t));
          }
        }
      }
    }
    for (int r = 0; r < R; ++r)
      for (int h = 0; h < 2; ++h) store_bf16x8(_mm256_load_ps(total[r] + 8 * h), out + r * ldo + 8 * h);
  }
}

}  // namespace pagedllm::q4
