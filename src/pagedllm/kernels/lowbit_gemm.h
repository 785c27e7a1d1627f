// Pieces shared by the low-bit GEMMs (q4_gemm.cpp, q8_gemm.cpp): weights repacked into tiles
// of 16 output rows x 32 inputs (one scale group), multiplied by a few activation rows at a
// time, in float32 (bfloat16 pairs on AVX512-BF16) or as int8 codes (quantize_rows).
#pragma once
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <tuple>
#include <utility>

#include "plain.h"

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace pagedllm::lowbit {

constexpr int64_t kGroup = 32;  // inputs per scale group (GGUF's block)
constexpr int64_t kTile = 16;   // output rows per tile: one float32 vector
constexpr int kRowBlock = 8;    // activation rows per pass over a tile: 2 x 8 accumulator chains
// How far ahead (in tile blocks) the codes are asked for: the hardware prefetcher alone left
// q4_gemm waiting on memory (8 rows, 30 layers: 3.3 ms without, 2.5 ms 16 blocks ahead).
// They are asked into L2 (prefetcht1), not L1: on the Intel Xeons a prefetch into L1 holds
// one of the core's few L1 miss buffers until memory answers, which capped one thread's
// stream at one row below what a plain read gets (BENCHMARKS.md, "Decode at the memory floor").
constexpr int64_t kPrefetchBlocks = 16;

// By the bits: the kernels build with -ffast-math, under which std::isfinite may fold to true.
inline bool is_finite(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, 4);
  return (bits & 0x7F800000u) != 0x7F800000u;
}

inline void prefetch_ahead(const uint8_t* block, int64_t block_bytes) {
  const uint8_t* ahead = block + kPrefetchBlocks * block_bytes;
  for (int64_t line = 0; line < block_bytes; line += 64) __builtin_prefetch(ahead + line, 0, 2);
}

#if defined(__AVX2__)
// An accumulator as it stands, in a register: the compiler may not regroup the integer sums
// across it. Without it GCC (-O3 -ffast-math) turned the AVX2 tiles' chains into trees of all
// their products, every product stored to the stack first, at one row as at eight.
inline void in_register(__m256i& v) { asm volatile("" : "+x"(v)); }
#endif

#if defined(__AVX512F__)
// 16 float16 values (a tile's scales, as GGUF stores them) as float32.
inline __m512 load_halves(const uint8_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
#endif

#if defined(__AVX512BF16__)
// x[k], x[k + 1] in every 32-bit lane: the activation side of a pair dot product.
inline __m512bh broadcast_pair(const pagedllm::bf16* x) {
  int32_t pair;
  std::memcpy(&pair, x, 4);
  return (__m512bh)_mm512_set1_epi32(pair);
}
#endif

#if defined(__AVX512F__)
// 4 int8 activation codes in every 32-bit lane, broadcast straight from memory (read into a
// general register first, the broadcast cost q4_q8_gemm a third of its speed).
inline __m512i broadcast_quad(const int8_t* x) {
  return _mm512_broadcastd_epi32(_mm_loadu_si32(x));
}
#endif

// Activation rows rounded to int8 per group of 32 (or per block of groups: quantize_rows), the
// way llama.cpp feeds its integer dot products: codes = round(x * 127 / max|x|), with the
// scale max|x| / 127 and the codes' sum kept per row and group. A block holding a NaN or an
// infinity gets codes 0 and a NaN scale, so the outputs read NaN (casting NaN to an integer
// would be undefined).
struct Int8Rows {
  std::unique_ptr<int8_t[]> codes;  // [M, K]
  std::unique_ptr<float[]> scale;   // [M, K / 32]
  std::unique_ptr<int32_t[]> sum;   // [M, K / 32]
};

#if defined(__AVX512BW__)
// A group's 32 bfloat16 values (v) as two halves of float32 bit patterns.
inline void load_group(const uint16_t* v, __m512i& lo, __m512i& hi) {
  lo = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)v)), 16);
  hi = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(v + 16))), 16);
}

// The bits of a group's largest |x|: for non-negative floats the integer order is the float
// order, and an infinity or NaN compares above every finite value.
inline uint32_t group_top(const uint16_t* v) {
  __m512i lo, hi;
  load_group(v, lo, hi);
  const __m512i magnitude = _mm512_set1_epi32(0x7FFFFFFF);
  return _mm512_reduce_max_epu32(_mm512_max_epu32(_mm512_and_si512(lo, magnitude), _mm512_and_si512(hi, magnitude)));
}

// One group of 32 bfloat16 values (v) to codes against the largest |x| of its scale's block
// (top, by its bits), returning (scale, sum). kInterleaved stores each 8 codes in the order
// 0 4 1 5 2 6 3 7: the order in which q4_q8_gemm finds 4-bit weight codes in the bytes of a
// lane (see q4_layout.h's code_shift).
template <bool kInterleaved>
inline std::pair<float, int32_t> quantize_group(const uint16_t* v, int8_t* codes, uint32_t top) {
  const __m128i order = kInterleaved ? _mm_setr_epi8(0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15)
                                     : _mm_setr_epi8(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __m512i lo, hi;
  load_group(v, lo, hi);
  const bool finite = top < 0x7F800000u;
  float amax;
  std::memcpy(&amax, &top, 4);
  const float inv = finite && amax > 0.0f ? 127.0f / amax : 0.0f;
  __m512i qlo = _mm512_setzero_si512(), qhi = _mm512_setzero_si512();
  if (finite) {
    qlo = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_castsi512_ps(lo), _mm512_set1_ps(inv)));
    qhi = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_castsi512_ps(hi), _mm512_set1_ps(inv)));
  }
  _mm_storeu_si128((__m128i*)codes, _mm_shuffle_epi8(_mm512_cvtepi32_epi8(qlo), order));
  _mm_storeu_si128((__m128i*)(codes + 16), _mm_shuffle_epi8(_mm512_cvtepi32_epi8(qhi), order));
  return {finite ? amax / 127.0f : std::numeric_limits<float>::quiet_NaN(),
          _mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi))};
}
#elif defined(__AVX2__)
// The AVX2 forms of quantize_group and split_group (the avx2 build: a decode step's every
// projection rounds its activations first, and the plain C++ loops cost a tenth of a 16-row
// step there). Same rounding (the conversion rounds half to even, as nearbyint), same order.

// A group's 32 bfloat16 values as 4 x 8 float32 bit patterns, and its largest |x| bits.
inline uint32_t load_group(const uint16_t* v, __m256i (&x)[4]) {
  const __m256i magnitude = _mm256_set1_epi32(0x7FFFFFFF);
  __m256i top = _mm256_setzero_si256();
  for (int i = 0; i < 4; ++i) {
    x[i] = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(v + 8 * i))), 16);
    top = _mm256_max_epu32(top, _mm256_and_si256(x[i], magnitude));
  }
  __m128i m = _mm_max_epu32(_mm256_castsi256_si128(top), _mm256_extracti128_si256(top, 1));
  m = _mm_max_epu32(m, _mm_shuffle_epi32(m, 0x4E));
  m = _mm_max_epu32(m, _mm_shuffle_epi32(m, 0xB1));
  return static_cast<uint32_t>(_mm_cvtsi128_si32(m));
}

// 4 x 8 int32 in -128..127 as 32 int8 codes, in natural or interleaved order (see above).
template <bool kInterleaved>
inline void store_codes(const __m256i (&q)[4], int8_t* codes) {
  // packs work within 128-bit lanes: dwords come out as a0-3 b0-3 c0-3 d0-3 | a4-7 ... d4-7.
  const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
  __m256i ordered = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  if constexpr (kInterleaved)
    ordered = _mm256_shuffle_epi8(ordered, _mm256_setr_epi8(0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15,
                                                            0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15));
  _mm256_storeu_si256((__m256i*)codes, ordered);
}

inline int32_t sum_int32(const __m256i (&q)[4]) {
  const __m256i s = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
  __m128i m = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
  m = _mm_add_epi32(m, _mm_shuffle_epi32(m, 0x4E));
  m = _mm_add_epi32(m, _mm_shuffle_epi32(m, 0xB1));
  return _mm_cvtsi128_si32(m);
}

inline uint32_t group_top(const uint16_t* v) {
  __m256i x[4];
  return load_group(v, x);
}

template <bool kInterleaved>
inline std::pair<float, int32_t> quantize_group(const uint16_t* v, int8_t* codes, uint32_t top) {
  __m256i x[4], q[4];
  load_group(v, x);
  const bool finite = top < 0x7F800000u;
  float amax;
  std::memcpy(&amax, &top, 4);
  const __m256 inv = _mm256_set1_ps(finite && amax > 0.0f ? 127.0f / amax : 0.0f);
  for (int i = 0; i < 4; ++i)
    q[i] = finite ? _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_castsi256_ps(x[i]), inv)) : _mm256_setzero_si256();
  store_codes<kInterleaved>(q, codes);
  return {finite ? amax / 127.0f : std::numeric_limits<float>::quiet_NaN(), sum_int32(q)};
}
#else
// The same rounding in plain C++ (the portable build): nearbyint rounds half to even, as
// the vector conversion does. max |x| by its bits, as above: NaN and infinity compare highest.
inline uint32_t group_top(const uint16_t* v) {
  uint32_t top = 0;
  for (int64_t e = 0; e < kGroup; ++e) top = std::max(top, (static_cast<uint32_t>(v[e]) << 16) & 0x7FFFFFFFu);
  return top;
}

template <bool kInterleaved>
inline std::pair<float, int32_t> quantize_group(const uint16_t* v, int8_t* codes, uint32_t top) {
  // Where input e of each 8 is stored when interleaved (the inverse of the order above).
  static constexpr int kPosition[8] = {0, 2, 4, 6, 1, 3, 5, 7};
  const bool finite = top < 0x7F800000u;
  float amax;
  std::memcpy(&amax, &top, 4);
  const float inv = finite && amax > 0.0f ? 127.0f / amax : 0.0f;
  int32_t sum = 0;
  for (int64_t e = 0; e < kGroup; ++e) {
    const uint32_t bits = static_cast<uint32_t>(v[e]) << 16;
    float value;
    std::memcpy(&value, &bits, 4);
    const int32_t code = finite ? static_cast<int32_t>(std::nearbyint(value * inv)) : 0;
    codes[kInterleaved ? (e & ~int64_t{7}) + kPosition[e & 7] : e] = static_cast<int8_t>(code);
    sum += code;
  }
  return {finite ? amax / 127.0f : std::numeric_limits<float>::quiet_NaN(), sum};
}
#endif

#if defined(__AVX512BW__) || defined(__AVX2__)
// The int16 split, in the builds with an int16 tile (q4_tiles_avx512.h, q4_tiles_avx2.h).
// Activation rows as 16-bit integers per group of 32, held as two int8 halves so that the
// int8 tiles' integer dot products take them: x = scale * xi, xi = 256 * hi + lo, hi and lo
// in -128..127 (q4_i16_gemm). The scale is a power of two that maps the group's largest
// binade to [2^13, 2^14): every bfloat16 value within 6 binades of the group's largest is
// exact (it has 8 significant bits), the rest round at 2^-14 of the largest, 32 times finer
// than bfloat16 rounds the largest value itself. Codes interleaved as quantize_rows<true>
// stores them. A group holding a NaN or an infinity gets codes 0 and a NaN scale, as
// quantize_group gives it.
struct Int16Rows {
  std::unique_ptr<int8_t[]> high;  // [M, K]
  std::unique_ptr<int8_t[]> low;   // [M, K]
  std::unique_ptr<float[]> scale;  // [M, K / 32]
  std::unique_ptr<float[]> sum;    // [M, K / 32]: scale * sum(xi), for the m term
};

// A group's multiplier from the bits of its largest |x| (top): the power of two 2^(140 - e),
// e its biased exponent, that maps it to [2^13, 2^14), and the group's scale, its inverse
// (exact: a power of two). Below 2^-113 the multiplier stays at 2^127 (float32's largest
// power of two). False where the group holds a NaN or an infinity: its codes are then 0 and
// its scale and sum NaN, so its row's outputs read NaN.
inline bool split_multiplier(uint32_t top, int8_t* high, int8_t* low, float& scale, float& sum,
                             float& up) {
  if (top >= 0x7F800000u) {
    std::memset(high, 0, kGroup);
    std::memset(low, 0, kGroup);
    scale = sum = std::numeric_limits<float>::quiet_NaN();
    return false;
  }
  const int32_t e = static_cast<int32_t>(top >> 23);
  const uint32_t up_bits = static_cast<uint32_t>(std::min<int32_t>(267 - e, 254)) << 23;
  std::memcpy(&up, &up_bits, 4);
  scale = 1.0f / up;
  return true;
}

#if defined(__AVX512BW__)
inline void split_group(const uint16_t* v, int8_t* high, int8_t* low, float& scale, float& sum) {
  const __m128i order = _mm_setr_epi8(0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15);
  const __m512i a = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)v)), 16);
  const __m512i b = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(v + 16))), 16);
  const __m512i magnitude = _mm512_set1_epi32(0x7FFFFFFF);
  const uint32_t top = _mm512_reduce_max_epu32(
      _mm512_max_epu32(_mm512_and_si512(a, magnitude), _mm512_and_si512(b, magnitude)));
  float up;
  if (!split_multiplier(top, high, low, scale, sum, up)) return;
  const __m512i ia = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_castsi512_ps(a), _mm512_set1_ps(up)));
  const __m512i ib = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_castsi512_ps(b), _mm512_set1_ps(up)));
  // |xi| < 2^14: hi = round(xi / 256) in -64..64, lo = xi - 256 hi in -128..127.
  const __m512i half = _mm512_set1_epi32(128);
  const __m512i ha = _mm512_srai_epi32(_mm512_add_epi32(ia, half), 8);
  const __m512i hb = _mm512_srai_epi32(_mm512_add_epi32(ib, half), 8);
  const __m512i la = _mm512_sub_epi32(ia, _mm512_slli_epi32(ha, 8));
  const __m512i lb = _mm512_sub_epi32(ib, _mm512_slli_epi32(hb, 8));
  _mm_storeu_si128((__m128i*)high, _mm_shuffle_epi8(_mm512_cvtepi32_epi8(ha), order));
  _mm_storeu_si128((__m128i*)(high + 16), _mm_shuffle_epi8(_mm512_cvtepi32_epi8(hb), order));
  _mm_storeu_si128((__m128i*)low, _mm_shuffle_epi8(_mm512_cvtepi32_epi8(la), order));
  _mm_storeu_si128((__m128i*)(low + 16), _mm_shuffle_epi8(_mm512_cvtepi32_epi8(lb), order));
  sum = scale * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(ia, ib)));
}

#elif defined(__AVX2__)
// The same split with AVX2 (the avx2 build's int16 tile, q4_tiles_avx2.h).
inline void split_group(const uint16_t* v, int8_t* high, int8_t* low, float& scale, float& sum) {
  __m256i x[4], xi[4], hi[4], lo[4];
  const uint32_t top = load_group(v, x);
  float up;
  if (!split_multiplier(top, high, low, scale, sum, up)) return;
  const __m256 upv = _mm256_set1_ps(up);
  const __m256i half = _mm256_set1_epi32(128);
  for (int i = 0; i < 4; ++i) {
    xi[i] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_castsi256_ps(x[i]), upv));
    hi[i] = _mm256_srai_epi32(_mm256_add_epi32(xi[i], half), 8);
    lo[i] = _mm256_sub_epi32(xi[i], _mm256_slli_epi32(hi[i], 8));
  }
  store_codes<true>(hi, high);
  store_codes<true>(lo, low);
  sum = scale * static_cast<float>(sum_int32(xi));
}
#endif

// x [rows, k] bfloat16, k a multiple of 32. A decode step's few rows stay on one thread (the
// grain); a prefill's are split as quantize_rows splits them.
inline Int16Rows split_rows(const bf16* x, int64_t rows, int64_t k) {
  const int64_t groups = rows * (k / kGroup);
  Int16Rows q{pagedllm::scratch<int8_t>(rows * k), pagedllm::scratch<int8_t>(rows * k),
              pagedllm::scratch<float>(groups), pagedllm::scratch<float>(groups)};
  const auto* xp = reinterpret_cast<const uint16_t*>(x);
  parallel_for(0, groups, 1024, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      split_group(xp + i * kGroup, q.high.get() + i * kGroup, q.low.get() + i * kGroup, q.scale[i], q.sum[i]);
  });
  return q;
}
#endif  // the int16 split

// x [rows, k] bfloat16, k a multiple of 32 * groups_per_scale. One scale serves
// groups_per_scale neighbouring groups (its block): 1 for the Q4_0/Q4_1/Q6_K/Q8_0 products, 8
// (256 inputs) for Q4_K's, whose 6-bit sub-scales the avx2 tile can then fold in integers, as
// llama.cpp's Q8_K rounds activations for its k-quants. Scale and sum are still kept per group
// (a block's groups share the scale).
template <bool kInterleaved>
Int8Rows quantize_rows(const bf16* x, int64_t rows, int64_t k, int64_t groups_per_scale = 1) {
  const int64_t groups = rows * (k / kGroup);
  Int8Rows q{pagedllm::scratch<int8_t>(rows * k),
             pagedllm::scratch<float>(groups),
             pagedllm::scratch<int32_t>(groups)};
  const auto* xp = reinterpret_cast<const uint16_t*>(x);
  int8_t* cp = q.codes.get();
  float* sp = q.scale.get();
  int32_t* up = q.sum.get();
  const int64_t per = groups_per_scale;
  parallel_for(0, groups / per, std::max<int64_t>(1, 64 / per), [&](int64_t begin, int64_t end) {
    // Block b of the flat [M, K] (blocks never straddle rows).
    for (int64_t b = begin; b < end; ++b) {
      uint32_t top = 0;
      for (int64_t i = b * per; i < (b + 1) * per; ++i) top = std::max(top, group_top(xp + i * kGroup));
      for (int64_t i = b * per; i < (b + 1) * per; ++i)
        std::tie(sp[i], up[i]) = quantize_group<kInterleaved>(xp + i * kGroup, cp + i * kGroup, top);
    }
  });
  return q;
}

// Calls whole(t) for every tile of output rows, with all the activation rows (the AVX2 Q6_K
// tile of a prefill, which unpacks each block of a tile once for all of them; for_each_tile
// below splits the rows into blocks). Threads take tiles a few at a time from a shared
// counter instead of an even split fixed up front: on a host whose cores are shared (the
// server's HTTP thread, the clients, other tenants), a thread that loses its core for a while
// leaves its tiles to the others instead of holding up the whole product. A decode step of up to 4 rows is bound by
// reading each tile once, so there a thread takes runs of up to 8 neighbouring tiles,
// whose bytes follow each other, so its prefetches ahead land in its own next tiles (taking
// them one at a time, each thread started every other tile cold, which slowed the default
// model's narrow projections most: docs/benchmarks/log.md, 2026-12-07).
template <typename Fn>
void for_each_whole_tile(int64_t tiles, int64_t rows, const Fn& whole) {
  const int64_t threads = num_threads();
  const int64_t run = rows <= 4 ? std::min<int64_t>(8, (tiles + 2 * threads - 1) / (2 * threads)) : 1;
  const int64_t chunk = std::max<int64_t>({1, run, tiles / (threads * 16)});
  std::atomic<int64_t> next{0};
  parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (int64_t begin = next.fetch_add(chunk); begin < tiles; begin = next.fetch_add(chunk))
      for (int64_t t = begin; t < std::min(tiles, begin + chunk); ++t) whole(t);
  });
}

// Calls tile(t, r0, rows) for every tile and block of up to kRowBlock activation rows, a
// tile's blocks one after another on the thread that took it.
template <typename Fn>
void for_each_tile(int64_t tiles, int64_t rows, const Fn& tile) {
  for_each_whole_tile(tiles, rows, [&](int64_t t) {
    for (int64_t r0 = 0; r0 < rows; r0 += kRowBlock)
      tile(t, r0, static_cast<int>(std::min<int64_t>(kRowBlock, rows - r0)));
  });
}

}  // namespace pagedllm::lowbit
