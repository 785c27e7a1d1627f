// The 4-bit tiles with AVX-512 intrinsics (the avx512 build): q4_gemm's exact tile on
// AVX512-BF16 pair dot products, q4_q8_gemm's and q4_i16_gemm's on AVX512-VNNI. Included by
// q4_gemm.cpp only.
#pragma once
#include "q4_layout.h"

namespace pagedllm::q4 {

// quantize_rows stores each 8 activation codes in the order the int8 tile reads nibbles.
constexpr bool kInterleavedCodes = true;
// The exact tile takes the bfloat16 activations as they are (pair dot products).
using ExactInput = pagedllm::bf16;

// 16 bytes (a group's 6-bit scales or mins of the tile's rows) as float32.
inline __m512 load_bytes(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// Group g's d and m for the tile's 16 rows: w = d * q + m.
template <class L>
inline void group_scales(const uint8_t* tile, int64_t g, __m512& d, __m512& m) {
  const uint8_t* block = tile + g / L::kGroupsPerBlock * L::kBlockBytes;
  if constexpr (L::kGroupsPerBlock == 1) {
    d = load_halves(block + kCodeBytes);
    m = load_halves(block + kCodeBytes + 32);
  } else {
    const int64_t j = g % L::kGroupsPerBlock;
    d = _mm512_mul_ps(load_halves(block + L::kDOffset), load_bytes(block + L::kScaleOffset + kTile * j));
    m = _mm512_mul_ps(load_halves(block + L::kDminOffset), load_bytes(block + L::kMinOffset + kTile * j));
  }
}

#if defined(__AVX512BF16__)

template <int P>
inline __m512bh codes_pair(__m512i v) {
  const __m512i q = _mm512_and_si512(_mm512_srli_epi32(v, 4 * P), _mm512_set1_epi32(0x000F000F));
  return (__m512bh)_mm512_or_si512(q, _mm512_set1_epi32(0x43004300));  // bfloat16 128 + q
}

template <int R, int S, int P>
inline void dot_pair(__m512 (&acc)[S][R], __m512i v, const pagedllm::bf16* x, int64_t ldx, int64_t k) {
  const __m512bh w = codes_pair<P>(v);
  for (int r = 0; r < R; ++r)
    acc[P % S][r] = _mm512_dpbf16_ps(acc[P % S][r], w, broadcast_pair(x + r * ldx + k + 2 * P));
}

// R rows of x times one tile of 16 output rows. The dot products run in R * S independent
// chains (S sets of accumulators taking turns): the instruction's latency needs about a dozen
// in flight to keep both of its pipes busy. The float32 totals live in memory, touched once
// per group, so that the registers go to the chains.
template <class L, int R, int S>
void tile_rows_chains(const uint8_t* tile, int64_t groups, const pagedllm::bf16* x, int64_t ldx,
               const float* xsum, pagedllm::bf16* out, int64_t ldo) {
  alignas(64) float total[R][kTile] = {};
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* block = group_codes<L>(tile, g);
    prefetch_group<L>(tile, g);
    __m512 acc[S][R];
    for (int s = 0; s < S; ++s)
      for (int r = 0; r < R; ++r) acc[s][r] = _mm512_setzero_ps();
    for (int j = 0; j < 4; ++j) {
      const __m512i v = _mm512_loadu_si512(block + 64 * j);
      const int64_t k = g * kGroup + 8 * j;
      dot_pair<R, S, 0>(acc, v, x, ldx, k);
      dot_pair<R, S, 1>(acc, v, x, ldx, k);
      dot_pair<R, S, 2>(acc, v, x, ldx, k);
      dot_pair<R, S, 3>(acc, v, x, ldx, k);
    }
    __m512 d, m;
    group_scales<L>(tile, g, d, m);
    const __m512 m_shifted = _mm512_fnmadd_ps(d, _mm512_set1_ps(128.0f), m);  // m - 128 d
    for (int r = 0; r < R; ++r) {
      __m512 sum = acc[0][r];
      for (int s = 1; s < S; ++s) sum = _mm512_add_ps(sum, acc[s][r]);
      __m512 t = _mm512_fmadd_ps(sum, d, _mm512_load_ps(total[r]));
      _mm512_store_ps(total[r], _mm512_fmadd_ps(m_shifted, _mm512_set1_ps(xsum[r * groups + g]), t));
    }
  }
  for (int r = 0; r < R; ++r)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * ldo),
                        (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(total[r])));
}

// The entry the tile table takes (q4_gemm.cpp): two sets of accumulators taking turns, for
// every row count, so that a row's float32 sums come out the same whatever rows share its
// step (speculative decoding's verification relies on it: models/decode_loop.py).
template <class L, int R>
void tile_rows(const uint8_t* tile, int64_t groups, const pagedllm::bf16* x, int64_t ldx,
               const float* xsum, pagedllm::bf16* out, int64_t ldo) {
  tile_rows_chains<L, R, 2>(tile, groups, x, ldx, xsum, out, ldo);
}

#endif  // __AVX512BF16__

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)

// R rows of int8 activations (quantize_rows<true>) times one tile, for q4_q8_gemm. A code
// vector's lane holds 8 codes of one output row; masking the low and the high nibble of each
// byte gives two lanes of 4 codes as unsigned bytes, inputs (0 4 1 5) and (2 6 3 7), which
// the interleaved activation codes match. Per group:
//   sum x*w = dx * (d * (xq . q) + m * sum(xq)),
// the integer dot product exact in int32, the scales applied once per 32 inputs.
template <class L, int R>
void tile_rows_int8(const uint8_t* tile, int64_t groups, const int8_t* xq, int64_t ldx,
                    const float* dx, const float* dx_sum, const int32_t* /*sum_pairs*/, pagedllm::bf16* out,
                    int64_t ldo) {
  // Independent accumulator chains per row: the 8 dot products of a group in one chain per
  // row wait on each other's latency when the rows are few.
  constexpr int S = R <= 2 ? 4 : (R <= 4 ? 2 : 1);
  __m512 total[R];
  for (int r = 0; r < R; ++r) total[r] = _mm512_setzero_ps();
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* block = group_codes<L>(tile, g);
    prefetch_group<L>(tile, g);
    __m512i acc[S][R];
    for (int s = 0; s < S; ++s)
      for (int r = 0; r < R; ++r) acc[s][r] = _mm512_setzero_si512();
    for (int j = 0; j < 4; ++j) {
      const __m512i v = _mm512_loadu_si512(block + 64 * j);
      const __m512i low = _mm512_and_si512(v, nibble);
      const __m512i high = _mm512_and_si512(_mm512_srli_epi32(v, 4), nibble);
      const int8_t* x = xq + g * kGroup + 8 * j;
      for (int r = 0; r < R; ++r) {
        __m512i& a = acc[(2 * j) % S][r];
        __m512i& b = acc[(2 * j + 1) % S][r];
        a = _mm512_dpbusd_epi32(a, low, broadcast_quad(x + r * ldx));
        b = _mm512_dpbusd_epi32(b, high, broadcast_quad(x + r * ldx + 4));
      }
    }
    __m512 d, m;
    group_scales<L>(tile, g, d, m);
    for (int r = 0; r < R; ++r) {
      __m512i sum = acc[0][r];
      for (int s = 1; s < S; ++s) sum = _mm512_add_epi32(sum, acc[s][r]);
      const __m512 scale = _mm512_mul_ps(d, _mm512_set1_ps(dx[r * groups + g]));
      total[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), scale, total[r]);
      total[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(dx_sum[r * groups + g]), total[r]);
    }
  }
  for (int r = 0; r < R; ++r)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * ldo), (__m256i)_mm512_cvtneps_pbh(total[r]));
}

// The few-row product where bfloat16 pair dot products are slow (Intel's cores issue
// vdpbf16ps at a quarter of vpdpbusd's rate: BENCHMARKS.md): R rows of activations as 16-bit
// integers held in two int8 halves (split_rows) times one tile. The int8 tile's dot products
// run twice, on hi and on lo, and recombine exactly in int32 per group:
//   sum x*w = dx * (d * (256 * (hi . q) + lo . q) + m * sum(xi)).
// The sums are integers, so a row's result does not depend on the order of the chains, nor
// on which rows share the call.
#define PAGEDLLM_INT16_TILES 1
template <class L, int R>
void tile_rows_int16(const uint8_t* tile, int64_t groups, const int8_t* xh, const int8_t* xl,
                     int64_t ldx, const float* dx, const float* dx_sum, pagedllm::bf16* out, int64_t ldo) {
  // Chains per half and row: a group's 8 dot products of a half in one chain per row wait on
  // each other's latency when the rows are few.
  constexpr int S = R == 1 ? 4 : (R <= 4 ? 2 : 1);
  __m512 total[R];
  for (int r = 0; r < R; ++r) total[r] = _mm512_setzero_ps();
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* block = group_codes<L>(tile, g);
    prefetch_group<L>(tile, g);
    __m512i hi[S][R], lo[S][R];
    for (int s = 0; s < S; ++s)
      for (int r = 0; r < R; ++r) hi[s][r] = lo[s][r] = _mm512_setzero_si512();
    for (int j = 0; j < 4; ++j) {
      const __m512i v = _mm512_loadu_si512(block + 64 * j);
      const __m512i low = _mm512_and_si512(v, nibble);
      const __m512i high = _mm512_and_si512(_mm512_srli_epi32(v, 4), nibble);
      const int64_t k = g * kGroup + 8 * j;
      for (int r = 0; r < R; ++r) {
        __m512i& h0 = hi[(2 * j) % S][r];
        __m512i& l0 = lo[(2 * j) % S][r];
        h0 = _mm512_dpbusd_epi32(h0, low, broadcast_quad(xh + r * ldx + k));
        l0 = _mm512_dpbusd_epi32(l0, low, broadcast_quad(xl + r * ldx + k));
        __m512i& h1 = hi[(2 * j + 1) % S][r];
        __m512i& l1 = lo[(2 * j + 1) % S][r];
        h1 = _mm512_dpbusd_epi32(h1, high, broadcast_quad(xh + r * ldx + k + 4));
        l1 = _mm512_dpbusd_epi32(l1, high, broadcast_quad(xl + r * ldx + k + 4));
      }
    }
    __m512 d, m;
    group_scales<L>(tile, g, d, m);
    for (int r = 0; r < R; ++r) {
      __m512i h = hi[0][r], l = lo[0][r];
      for (int s = 1; s < S; ++s) {
        h = _mm512_add_epi32(h, hi[s][r]);
        l = _mm512_add_epi32(l, lo[s][r]);
      }
      const __m512i sum = _mm512_add_epi32(_mm512_slli_epi32(h, 8), l);
      const __m512 scale = _mm512_mul_ps(d, _mm512_set1_ps(dx[r * groups + g]));
      total[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), scale, total[r]);
      total[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(dx_sum[r * groups + g]), total[r]);
    }
  }
  for (int r = 0; r < R; ++r)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * ldo), (__m256i)_mm512_cvtneps_pbh(total[r]));
}

#endif  // __AVX512VNNI__


}  // namespace pagedllm::q4
