// q.k scores of a group of query heads against one KV head's paged keys, scaled: what each
// build of the per-token attention uses (paged_attention.cpp). bfloat16 caches: AVX512-BF16
// pair dot products on the avx512 level, float32 (vectorised by the compiler) elsewhere.
// int8 caches: the query rounded to int8 and integer dot products (AVX512-VNNI on avx512,
// plain C++ elsewhere). scores [G][len - first]: the context is positions first .. len - 1
// (first > 0 under a sliding window). Head sizes that are not a multiple of the vector
// (80, 96) load their last vector masked: the lanes past D read as zero.
#pragma once
#include <cmath>
#include <cstdint>

#include "paged_rows.h"

#if defined(__AVX512F__)
#include <immintrin.h>

// Sums of each of four vectors, as one 4-float vector: a shared shuffle tree, several times
// cheaper than four separate horizontal reductions.
static inline __m128 reduce4(__m512 a, __m512 b, __m512 c, __m512 d) {
  const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
  const __m512 abcd = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(1, 0, 1, 0)),
                                    _mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(3, 2, 3, 2)));
  const __m256 half = _mm256_add_ps(_mm512_castps512_ps256(abcd), _mm512_extractf32x8_ps(abcd, 1));
  return _mm_add_ps(_mm256_castps256_ps128(half), _mm256_extractf128_ps(half, 1));
}

// Vector v of a row of D bfloat16s (32 a vector), masked past D.
template <int D>
static inline __m512i load_bf16_vector(const pagedllm::bf16* row, int v) {
  if ((v + 1) * 32 <= D) return _mm512_loadu_si512(row + v * 32);
  return _mm512_maskz_loadu_epi16(static_cast<__mmask32>((1u << (D - v * 32)) - 1u), row + v * 32);
}

// Vector v of a row of D int8 codes (64 a vector), masked past D.
template <int D>
static inline __m512i load_int8_vector(const int8_t* row, int v) {
  if ((v + 1) * 64 <= D) return _mm512_loadu_si512(row + v * 64);
  return _mm512_maskz_loadu_epi8(static_cast<__mmask64>((1ull << (D - v * 64)) - 1ull), row + v * 64);
}

#endif

#if defined(__AVX512BF16__)

// q.k for bfloat16 caches with the AVX512-BF16 dot-product instruction: bf16 pairs multiplied
// exactly and summed in float32, four tokens at a time. scores [G][len - first], scaled.
template <int D, int G>
static void qk_scores_bf16(const pagedllm::bf16* query, const HeadRows<pagedllm::bf16>& keys,
                           const int64_t* table, int64_t first, int64_t len, float scale,
                           float* scores) {
  constexpr int V = (D + 31) / 32;  // 512-bit vectors per row
  const int64_t token_stride = keys.token_stride, ctx = len - first;
  __m512bh q[G][V];
  for (int g = 0; g < G; ++g)
    for (int v = 0; v < V; ++v) q[g][v] = (__m512bh)load_bf16_vector<D>(query + g * D, v);
  for_each_block(keys, table, first, len, D, [&](const pagedllm::bf16* k, const float*, int64_t start, int64_t n) {
    int64_t j = 0;
    for (; j + 4 <= n; j += 4) {
      __m512bh rows[4][V];
      for (int r = 0; r < 4; ++r)
        for (int v = 0; v < V; ++v)
          rows[r][v] = (__m512bh)load_bf16_vector<D>(k + (j + r) * token_stride, v);
      for (int g = 0; g < G; ++g) {
        __m512 acc[4];
        for (int r = 0; r < 4; ++r) {
          acc[r] = _mm512_dpbf16_ps(_mm512_setzero_ps(), q[g][0], rows[r][0]);
          for (int v = 1; v < V; ++v) acc[r] = _mm512_dpbf16_ps(acc[r], q[g][v], rows[r][v]);
        }
        const __m128 s = _mm_mul_ps(reduce4(acc[0], acc[1], acc[2], acc[3]), _mm_set1_ps(scale));
        _mm_storeu_ps(scores + g * ctx + start + j, s);
      }
    }
    for (; j < n; ++j) {
      for (int g = 0; g < G; ++g) {
        __m512 acc = _mm512_setzero_ps();
        for (int v = 0; v < V; ++v)
          acc = _mm512_dpbf16_ps(acc, q[g][v], (__m512bh)load_bf16_vector<D>(k + j * token_stride, v));
        scores[g * ctx + start + j] = _mm512_reduce_add_ps(acc) * scale;
      }
    }
  });
}
#endif

// The G query rows rounded to int8 for the int8 key cache's integer dot products, as
// llama.cpp rounds activations against a q8_0 cache: per row, scale max|q| / 127.
template <typename scalar_t, int D, int G>
struct QueryCodes {
  alignas(64) int8_t codes[G][D];
  float scale[G];  // times the softmax scale
  int32_t sum[G];  // sum of the codes
  QueryCodes(const scalar_t* query, float softmax_scale) {
    for (int g = 0; g < G; ++g) {
      float amax = 0.f;
      for (int d = 0; d < D; ++d) amax = std::max(amax, std::abs(Cvt<scalar_t>::load(query, g * D + d)));
      const float inv = amax > 0.f ? 127.f / amax : 0.f;
      sum[g] = 0;
      for (int d = 0; d < D; ++d) {
        const float x = std::min(127.f, std::max(-127.f, Cvt<scalar_t>::load(query, g * D + d) * inv));
        codes[g][d] = static_cast<int8_t>(std::nearbyint(x));
        sum[g] += codes[g][d];
      }
      scale[g] = amax / 127.f * softmax_scale;
    }
  }
};

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)

// q.k for int8 key caches with AVX512-VNNI: the key codes, flipped to unsigned (k + 128),
// times the query codes, 64 byte products an instruction, summed exactly in int32; the
// 128 * sum(q) the flip added is taken off, then both scales are applied. Four tokens at a
// time, as for bfloat16. scores [G][len - first], scaled.
template <typename scalar_t, int D, int G>
static void qk_scores_int8(const scalar_t* query, const HeadRows<int8_t>& keys,
                           const int64_t* table, int64_t first, int64_t len, float scale,
                           float* scores) {
  constexpr int V = (D + 63) / 64;  // 512-bit vectors per row
  const QueryCodes<scalar_t, D, G> qc(query, scale);
  const int64_t token_stride = keys.token_stride, kv_heads = keys.kv_heads, ctx = len - first;
  // Flipped codes past D are 128, times a query code of 0.
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512i q[G][V];
  for (int g = 0; g < G; ++g)
    for (int v = 0; v < V; ++v) q[g][v] = load_int8_vector<D>(qc.codes[g], v);
  for_each_block(keys, table, first, len, D, [&](const int8_t* k, const float* ks, int64_t start, int64_t n) {
    int64_t j = 0;
    for (; j + 4 <= n; j += 4) {
      __m512i rows[4][V];
      for (int r = 0; r < 4; ++r)
        for (int v = 0; v < V; ++v)
          rows[r][v] = _mm512_xor_si512(load_int8_vector<D>(k + (j + r) * token_stride, v), flip);
      const __m128 row_scale = _mm_setr_ps(ks[j * kv_heads], ks[(j + 1) * kv_heads],
                                           ks[(j + 2) * kv_heads], ks[(j + 3) * kv_heads]);
      for (int g = 0; g < G; ++g) {
        __m512 acc[4];
        for (int r = 0; r < 4; ++r) {
          __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), rows[r][0], q[g][0]);
          for (int v = 1; v < V; ++v) dot = _mm512_dpbusd_epi32(dot, rows[r][v], q[g][v]);
          acc[r] = _mm512_cvtepi32_ps(dot);  // exact: |lane| < 2^24
        }
        __m128 s = _mm_sub_ps(reduce4(acc[0], acc[1], acc[2], acc[3]), _mm_set1_ps(128.f * qc.sum[g]));
        s = _mm_mul_ps(_mm_mul_ps(s, row_scale), _mm_set1_ps(qc.scale[g]));
        _mm_storeu_ps(scores + g * ctx + start + j, s);
      }
    }
    for (; j < n; ++j) {
      for (int g = 0; g < G; ++g) {
        __m512i dot = _mm512_setzero_si512();
        for (int v = 0; v < V; ++v)
          dot = _mm512_dpbusd_epi32(
              dot, _mm512_xor_si512(load_int8_vector<D>(k + j * token_stride, v), flip), q[g][v]);
        scores[g * ctx + start + j] =
            static_cast<float>(_mm512_reduce_add_epi32(dot) - 128 * qc.sum[g]) * ks[j * kv_heads] * qc.scale[g];
      }
    }
  });
}
#else
// Without AVX512-VNNI: the same integer products, one at a time.
template <typename scalar_t, int D, int G>
static void qk_scores_int8(const scalar_t* query, const HeadRows<int8_t>& keys,
                           const int64_t* table, int64_t first, int64_t len, float scale,
                           float* scores) {
  const QueryCodes<scalar_t, D, G> qc(query, scale);
  const int64_t ctx = len - first;
  for_each_block(keys, table, first, len, D, [&](const int8_t* k, const float* ks, int64_t start, int64_t n) {
    for (int64_t j = 0; j < n; ++j, k += keys.token_stride)
      for (int g = 0; g < G; ++g) {
        int32_t dot = 0;
        for (int d = 0; d < D; ++d) dot += static_cast<int32_t>(qc.codes[g][d]) * k[d];
        scores[g * ctx + start + j] = static_cast<float>(dot) * ks[j * keys.kv_heads] * qc.scale[g];
      }
  });
}
#endif

// q.k for a float32 or bfloat16 cache, widened to float32. scores [G][len - first], scaled.
template <typename scalar_t, int D, int G>
static void qk_scores_generic(const scalar_t* __restrict__ query, const HeadRows<scalar_t>& keys,
                              const int64_t* __restrict__ table, int64_t first, int64_t len,
                              float scale, float* __restrict__ scores) {
  const int64_t ctx = len - first;
  alignas(64) float q[G][D];
  alignas(64) float row[D];
  for (int g = 0; g < G; ++g)
    for (int d = 0; d < D; ++d) q[g][d] = Cvt<scalar_t>::load(query, g * D + d) * scale;
  for_each_block(keys, table, first, len, D, [&](const scalar_t* k, const float*, int64_t start, int64_t n) {
    for (int64_t j = 0; j < n; ++j, k += keys.token_stride) {
      load_row<scalar_t, D>(k, row);
      for (int g = 0; g < G; ++g) {
        float s = 0.f;
        for (int d = 0; d < D; ++d) s += q[g][d] * row[d];
        scores[g * ctx + start + j] = s;
      }
    }
  });
}
