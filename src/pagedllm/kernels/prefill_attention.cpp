// Causal attention of a bfloat16 prefill chunk over the paged cache, in tiles: a task takes
// 16 query tokens of one KV head and walks their context 16 keys at a time. Each group of 16
// keys is read from its scattered blocks once per task, not once per token as in the
// per-token path (paged_attention.cpp), and laid out so that both products are AVX512-BF16
// dot products with no horizontal sums:
//   - q.k: kt[p] holds dimensions (2p, 2p + 1) of the 16 keys, one key a lane, so one dot
//     product per pair of dimensions gives a query row's 16 scores in one vector;
//   - p.v: vp[j] holds, for keys (2j, 2j + 1), their values of 16 dimensions, one dimension a
//     lane, so one dot product per pair of keys adds both keys' weighted values. The
//     probabilities are rounded to bfloat16 for it, as FlashAttention does; the softmax
//     itself (online: running maximum and sum per row, the sums rescaled when the maximum
//     grows) stays float32, its sums adding the rounded weights so that they sum to 1.
// A token's GROUP query rows are processed together: they see the same keys, and their
// independent dot-product chains hide the instruction's latency. An int8 cache's rows are
// dequantized to bfloat16 as they are laid out, so the products are the same code.
// AttentionOptions (paged_cache.h): soft-capped scores go through a vector tanh before the
// softmax; under a sliding window a tile lays out only the keys its tokens see, and each
// token masks the keys before its window as it masks those after itself. Head sizes that
// are a multiple of 32 (64, 96, 128, 256) take this path; 80 takes the per-token one.
// The avx2 build has its own form of the tiles (AVX2 has no bfloat16 dot product): float32
// FMAs over keys laid out as float32, one group of 16 keys at a time, every token of the tile
// walking it before the next (see its attend_tile); every supported head size takes it.
// Other builds (portable) take the per-token path.
#include "kernels.h"
#include "paged_cache.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <new>
#include <vector>

#include "dtype.h"

#if defined(__AVX512BF16__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#define PAGEDLLM_TILED_PREFILL 1
#endif

namespace {

using pagedllm::bf16;
using pagedllm::DType;

constexpr int64_t kTileTokens = 16;  // query tokens per task
constexpr int kKeys = 16;            // keys per step: one float32 vector of scores
// Head sizes the tiles take: the AVX-512 value layout works in 32 dimensions, AVX2's in 8.
#if defined(__AVX512BF16__)
constexpr int64_t kTiledDims = 32;
#else
constexpr int64_t kTiledDims = 8;
#endif
// A finite "minus infinity": the kernels build with -ffast-math, which assumes no infinities.
constexpr float kMasked = -1e30f;

#if defined(PAGEDLLM_TILED_PREFILL)

struct Chunk {
  const bf16* query;  // [T, H, D]
  const PagedCache& cache;
  const int64_t* table;
  bf16* out;  // [T, H, D]
  int64_t heads, start;  // kv_heads and block_size: the cache's
  AttentionOptions options;
  // The first position the token at `position` sees.
  int64_t first_visible(int64_t position) const { return options.first_visible(position + 1); }
};

// std::vector storage aligned for 512-bit loads (the key groups hold __m512i).
template <typename T>
struct AlignedAllocator {
  using value_type = T;
  AlignedAllocator() = default;
  template <typename U>
  AlignedAllocator(const AlignedAllocator<U>&) {}
  T* allocate(size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t(64))); }
  void deallocate(T* p, size_t) { ::operator delete(p, std::align_val_t(64)); }
  bool operator==(const AlignedAllocator&) const { return true; }
  bool operator!=(const AlignedAllocator&) const { return false; }
};

// A cache row as bfloat16 bits: copied, or int8 codes times their scale, rounded to
// bfloat16 (once per tile, so the products below are the same for both caches).
template <int D>
inline void fetch_row(const pagedllm::bf16* row, const float*, uint16_t* out) {
  std::memcpy(out, row, D * sizeof(uint16_t));
}

template <int D>
inline void fetch_row(const int8_t* row, const float* scale, uint16_t* out) {
  const float s = *scale;
  for (int d = 0; d < D; ++d) out[d] = pagedllm::Cvt<pagedllm::bf16>::to_bits(static_cast<float>(row[d]) * s);
}

// Key k of a tile's group at `pos`, fetched as bfloat16 bits into key_row and value_row;
// false for keys before the window or past the context, which are laid out as zeros: their
// blocks may be back in the pool, and a weight of 0 times NaN is still NaN.
template <typename cache_t, int D>
inline bool fetch_key(const Chunk& c, const HeadRows<cache_t>& key_rows, const HeadRows<cache_t>& value_rows,
                      int64_t pos, bool live, uint16_t* key_row, uint16_t* value_row) {
  if (!live) return false;
  const int64_t block_size = c.cache.block_size;
  const int64_t slot = c.table[pos / block_size] * block_size + pos % block_size;
  fetch_row<D>(key_rows.cache + slot * key_rows.token_stride,
               key_rows.scales ? key_rows.scales + slot * key_rows.kv_heads : nullptr, key_row);
  fetch_row<D>(value_rows.cache + slot * value_rows.token_stride,
               value_rows.scales ? value_rows.scales + slot * value_rows.kv_heads : nullptr, value_row);
  return true;
}

// e^x at either width: x = n ln2 + r with |r| <= ln2 / 2 (ln2 in two parts), e^r by its
// Taylor polynomial to r^7 (relative error under 7.4e-8 over [-87, 0], checked against
// double exp), evaluated from 1/7! by Horner's rule through these, then scaled by 2^n.
constexpr float kLog2e = 1.44269504f, kLn2High = 0.693145752f, kLn2Low = 1.42860677e-6f;
constexpr float kExpTop = 1.0f / 5040;
constexpr float kExpPoly[] = {1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f};

#endif  // PAGEDLLM_TILED_PREFILL

#if defined(__AVX512BF16__)

// e^x for 16 floats, inline (a call per vector to the vectorised libm took ~40 % of the
// kernel), as kExpPoly says; x below -87 (masked keys) gives exactly 0.
inline __m512 exp512(__m512 x) {
  const __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_GE_OQ);
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Low), _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2High), x));
  __m512 p = _mm512_set1_ps(kExpTop);
  for (const float c : kExpPoly) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  return _mm512_maskz_scalef_ps(live, p, n);
}

// tanh for 16 floats, from exp512: (e^2x - 1) / (e^2x + 1), x clamped to +-9 where tanh is
// 1 to float precision (and e^2x stays finite).
inline __m512 tanh512(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-9.f)), _mm512_set1_ps(9.f));
  const __m512 e = exp512(_mm512_add_ps(x, x));
  return _mm512_div_ps(_mm512_sub_ps(e, _mm512_set1_ps(1.f)), _mm512_add_ps(e, _mm512_set1_ps(1.f)));
}

// Where lane i of value-pair vector v of a row lands among its D dimensions: unpacking two
// rows' 16-bit values interleaves them within each 128-bit quarter, 4 dimensions at a time.
template <int D>
int value_dim(int v, int i) {
  const int half = v / 2, high = v % 2;          // which 32 dimensions, which unpack
  const int quarter = i / 4, within = i % 4;     // 128-bit quarter of the vector, lane in it
  return half * 32 + quarter * 8 + high * 4 + within;
}

// Tokens t0 .. t0 + nt - 1, query heads head0 .. head0 + G - 1 of KV head kv. The tile's keys
// are laid out once (kt, vp: thread-local buffers, one group of 16 keys after another); then
// each token walks its groups with its rows' running maximum, sum and output in registers.
template <typename cache_t, int D, int G>
void attend_tile(const Chunk& c, int64_t kv, int64_t head0, int64_t t0, int64_t nt) {
  constexpr int P = D / 2;   // bf16 pairs in a key row
  constexpr int V = D / 16;  // float32 vectors in an output row
  struct KeyGroup {
    uint32_t kt[P][kKeys];
    __m512i vp[kKeys / 2][V];
  };
  const HeadRows<cache_t> key_rows = c.cache.head_rows<cache_t>(c.cache.key, c.cache.key_scales, kv);
  const HeadRows<cache_t> value_rows = c.cache.head_rows<cache_t>(c.cache.value, c.cache.value_scales, kv);
  const int64_t last = c.start + t0 + nt - 1;   // the last position any row sees
  const int64_t first_seen = c.first_visible(c.start + t0);  // the first position any row sees
  const int64_t first_group = first_seen / kKeys;
  const int64_t groups = last / kKeys + 1 - first_group;
  thread_local std::vector<KeyGroup, AlignedAllocator<KeyGroup>> buffer;
  if (static_cast<int64_t>(buffer.size()) < groups) buffer.resize(groups);
  for (int64_t gi = 0; gi < groups; ++gi) {
    KeyGroup& kg = buffer[gi];
    const int64_t k0 = (first_group + gi) * kKeys;
    const int nk = static_cast<int>(std::min<int64_t>(kKeys, last + 1 - k0));
    alignas(64) uint16_t values[kKeys][D];
    for (int k = 0; k < kKeys; ++k) {
      alignas(64) uint16_t key_row[D];
      if (fetch_key<cache_t, D>(c, key_rows, value_rows, k0 + k, k < nk && k0 + k >= first_seen,
                                key_row, values[k])) {
        uint32_t pairs[P];
        std::memcpy(pairs, key_row, sizeof(pairs));
        for (int p = 0; p < P; ++p) kg.kt[p][k] = pairs[p];
      } else {
        for (int p = 0; p < P; ++p) kg.kt[p][k] = 0;
        std::fill_n(values[k], D, 0);
      }
    }
    for (int j = 0; j < kKeys / 2; ++j)
      for (int h = 0; h < D / 32; ++h) {
        const __m512i a = _mm512_load_si512(values[2 * j] + 32 * h);
        const __m512i b = _mm512_load_si512(values[2 * j + 1] + 32 * h);
        kg.vp[j][2 * h] = _mm512_unpacklo_epi16(a, b);
        kg.vp[j][2 * h + 1] = _mm512_unpackhi_epi16(a, b);
      }
  }
  for (int64_t t = 0; t < nt; ++t) {
    const int64_t position = c.start + t0 + t;
    const int64_t first = c.first_visible(position);
    const auto* q = reinterpret_cast<const uint32_t*>(c.query + (t0 + t) * c.heads * D + head0 * D);
    float row_max[G], row_sum[G];
    __m512 out[G][V];
    for (int g = 0; g < G; ++g) {
      row_max[g] = kMasked;
      row_sum[g] = 0.f;
      for (int v = 0; v < V; ++v) out[g][v] = _mm512_setzero_ps();
    }
    for (int64_t gi = first / kKeys; gi * kKeys <= position; ++gi) {
      const KeyGroup& kg = buffer[gi - first_group];
      const int visible = static_cast<int>(std::min<int64_t>(position - gi * kKeys + 1, kKeys));
      const int hidden = static_cast<int>(std::max<int64_t>(first - gi * kKeys, 0));  // before the window
      // S chains of dot products per row: with G rows, enough in flight for the latency.
      constexpr int S = G >= 4 ? 2 : 4;
      __m512 s[G][S];
      for (int g = 0; g < G; ++g)
        for (int i = 0; i < S; ++i) s[g][i] = _mm512_setzero_ps();
      for (int p = 0; p < P; p += S)
        for (int i = 0; i < S; ++i) {
          const __m512bh keys = (__m512bh)_mm512_load_si512(kg.kt[p + i]);
          for (int g = 0; g < G; ++g)
            s[g][i] = _mm512_dpbf16_ps(s[g][i], keys, (__m512bh)_mm512_set1_epi32(q[g * P + p + i]));
        }
      for (int g = 0; g < G; ++g)
        for (int i = 1; i < S; ++i) s[g][0] = _mm512_add_ps(s[g][0], s[g][i]);
      // Keys after this token (and past the context), and before its window, are masked
      // out: probability 0.
      const __mmask16 keep = static_cast<__mmask16>(((1u << visible) - 1u) & ~((1u << hidden) - 1u));
      alignas(64) uint32_t prob_pairs[G][kKeys / 2];
      for (int g = 0; g < G; ++g) {
        __m512 sg = _mm512_mul_ps(s[g][0], _mm512_set1_ps(c.options.scale));
        if (c.options.softcap > 0.f)
          sg = _mm512_mul_ps(tanh512(_mm512_mul_ps(sg, _mm512_set1_ps(1.f / c.options.softcap))),
                             _mm512_set1_ps(c.options.softcap));
        sg = _mm512_mask_blend_ps(keep, _mm512_set1_ps(kMasked), sg);
        const float group_max = _mm512_reduce_max_ps(sg);
        if (group_max > row_max[g]) {  // a new maximum: rescale what was summed so far
          const float rescale = _mm512_cvtss_f32(exp512(_mm512_set1_ps(row_max[g] - group_max)));
          row_sum[g] *= rescale;
          for (int v = 0; v < V; ++v) out[g][v] = _mm512_mul_ps(out[g][v], _mm512_set1_ps(rescale));
          row_max[g] = group_max;
        }
        const __m512 pg = exp512(_mm512_sub_ps(sg, _mm512_set1_ps(row_max[g])));
        const __m256bh rounded = _mm512_cvtneps_pbh(pg);
        // The sum of the rounded weights p.v uses, so that they still add up to 1.
        row_sum[g] += _mm512_reduce_add_ps(_mm512_cvtpbh_ps(rounded));
        _mm256_store_si256(reinterpret_cast<__m256i*>(prob_pairs[g]), (__m256i)rounded);
      }
      for (int j = 0; 2 * j < visible; ++j)
        for (int v = 0; v < V; ++v)
          for (int g = 0; g < G; ++g)
            out[g][v] = _mm512_dpbf16_ps(out[g][v], (__m512bh)kg.vp[j][v],
                                         (__m512bh)_mm512_set1_epi32(prob_pairs[g][j]));
    }
    for (int g = 0; g < G; ++g) {
      pagedllm::bf16* o = c.out + (t0 + t) * c.heads * D + (head0 + g) * D;
      const float inv = 1.f / row_sum[g];
      alignas(64) float row[D];
      for (int v = 0; v < V; ++v) _mm512_store_ps(row + 16 * v, out[g][v]);
      for (int v = 0; v < V; ++v)
        for (int i = 0; i < 16; ++i)
          pagedllm::Cvt<pagedllm::bf16>::store(o, value_dim<D>(v, i), row[16 * v + i] * inv);
    }
  }
}

#elif defined(PAGEDLLM_TILED_PREFILL)

// The AVX2 form: float32 FMAs (AVX2 has no bfloat16 dot product), so the tile's keys are laid
// out as float32: kt[d] holds dimension d of the group's 16 keys, one key a lane (a query
// row's 16 scores are two vectors, no horizontal sums), and v[k] key k's values. The
// probabilities stay float32 for p.v, so this level's result is closer to float32 than the
// AVX-512 one. The softmax is the same online one.

// e^x for 8 floats, as kExpPoly says, 2^n written into the exponent bits (x within
// -87..88: every caller's range; x below -87 gives exactly 0).
inline __m256 exp256(__m256 x) {
  const __m256 live = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_GE_OQ);
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Low), _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2High), x));
  __m256 p = _mm256_set1_ps(kExpTop);
  for (const float c : kExpPoly) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
  const __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(two_n)), live);
}

// tanh for 8 floats, as tanh512.
inline __m256 tanh256(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-9.f)), _mm256_set1_ps(9.f));
  const __m256 e = exp256(_mm256_add_ps(x, x));
  return _mm256_div_ps(_mm256_sub_ps(e, _mm256_set1_ps(1.f)), _mm256_add_ps(e, _mm256_set1_ps(1.f)));
}

inline float max8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

inline float sum8(__m256 v) {
  __m128 m = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_add_ps(m, _mm_movehl_ps(m, m));
  m = _mm_add_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

inline float bf16_bits_to_float(uint16_t bits) {
  const uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// R query rows' scores against a group's 16 keys (two vectors a row), with 2 chains a vector
// over the dimensions: R <= 3 keeps the 4R chains, two key vectors and a broadcast in
// registers, and each key vector loaded serves R rows.
template <int D, int R>
inline void group_scores(const float (*kt)[kKeys], const float* const (&q)[R], __m256 (&a)[R][2]) {
  __m256 s[R][2][2];
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < 2; ++h) s[r][h][0] = s[r][h][1] = _mm256_setzero_ps();
  for (int d = 0; d < D; d += 2)
    for (int i = 0; i < 2; ++i) {
      const __m256 k0 = _mm256_load_ps(kt[d + i]), k1 = _mm256_load_ps(kt[d + i] + 8);
      for (int r = 0; r < R; ++r) {
        const __m256 qd = _mm256_broadcast_ss(q[r] + d + i);
        s[r][0][i] = _mm256_fmadd_ps(qd, k0, s[r][0][i]);
        s[r][1][i] = _mm256_fmadd_ps(qd, k1, s[r][1][i]);
      }
    }
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < 2; ++h) a[r][h] = _mm256_add_ps(s[r][h][0], s[r][h][1]);
}

// R rows' outputs += their probabilities times the group's values (keys hidden..visible-1),
// W vectors of the rows at a time so that the R x W chains stay in registers.
template <int D, int R>
inline void add_values(const float (*v)[D], const float (&probs)[R][kKeys], int hidden, int visible,
                       float* const (&out)[R]) {
  constexpr int V = D / 8, W = R == 1 ? 8 : 4;
  for (int v0 = 0; v0 < V; v0 += W) {
    __m256 acc[R][W];
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < W; ++i)
        if (v0 + i < V) acc[r][i] = _mm256_load_ps(out[r] + 8 * (v0 + i));
    for (int k = hidden; k < visible; ++k) {
      __m256 pk[R];
      for (int r = 0; r < R; ++r) pk[r] = _mm256_broadcast_ss(probs[r] + k);
      for (int i = 0; i < W; ++i)
        if (v0 + i < V) {
          const __m256 vk = _mm256_load_ps(v[k] + 8 * (v0 + i));
          for (int r = 0; r < R; ++r) acc[r][i] = _mm256_fmadd_ps(pk[r], vk, acc[r][i]);
        }
    }
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < W; ++i)
        if (v0 + i < V) _mm256_store_ps(out[r] + 8 * (v0 + i), acc[r][i]);
  }
}

// One row's step of the online softmax over a group: its 16 scores (two vectors) scaled,
// soft-capped and masked (keep: the keys it sees), its output rescaled when its maximum
// grows, and the group's probabilities written to probs.
template <int D>
inline void softmax_step(__m256 (&a)[2], const __m256 (&keep)[2], const AttentionOptions& options,
                         float& row_max, float& row_sum, float* out, float* probs) {
  for (int h = 0; h < 2; ++h) {
    a[h] = _mm256_mul_ps(a[h], _mm256_set1_ps(options.scale));
    if (options.softcap > 0.f)
      a[h] = _mm256_mul_ps(tanh256(_mm256_mul_ps(a[h], _mm256_set1_ps(1.f / options.softcap))),
                           _mm256_set1_ps(options.softcap));
    a[h] = _mm256_blendv_ps(_mm256_set1_ps(kMasked), a[h], keep[h]);
  }
  const float group_max = max8(_mm256_max_ps(a[0], a[1]));
  if (group_max > row_max) {  // a new maximum: rescale what was summed so far
    const __m256 rescale = exp256(_mm256_set1_ps(row_max - group_max));
    row_sum *= _mm256_cvtss_f32(rescale);
    for (int v = 0; v < D / 8; ++v)
      _mm256_store_ps(out + 8 * v, _mm256_mul_ps(_mm256_load_ps(out + 8 * v), rescale));
    row_max = group_max;
  }
  for (int h = 0; h < 2; ++h) {
    const __m256 p = exp256(_mm256_sub_ps(a[h], _mm256_set1_ps(row_max)));
    row_sum += sum8(p);
    _mm256_store_ps(probs + 8 * h, p);
  }
}

// Tokens t0 .. t0 + nt - 1, query heads head0 .. head0 + G - 1 of KV head kv. Unlike the
// AVX-512 tile, which lays out all of the tile's keys first (as bfloat16 pairs they fit in
// L2), the float32 groups are laid out one at a time and every token of the tile walks each
// before the next: the rows' running maximum, sum and output wait in memory (L1) meanwhile.
template <typename cache_t, int D, int G>
void attend_tile(const Chunk& c, int64_t kv, int64_t head0, int64_t t0, int64_t nt) {
  constexpr int kRows = kTileTokens * G;
  const HeadRows<cache_t> key_rows = c.cache.head_rows<cache_t>(c.cache.key, c.cache.key_scales, kv);
  const HeadRows<cache_t> value_rows = c.cache.head_rows<cache_t>(c.cache.value, c.cache.value_scales, kv);
  const int64_t last = c.start + t0 + nt - 1;
  const int64_t first_seen = c.first_visible(c.start + t0);
  // Per row (token t, head g: row t * G + g): its query as float32, running output, max, sum.
  thread_local std::vector<float, AlignedAllocator<float>> rows;
  rows.resize(2 * kRows * D);
  float* const query = rows.data();
  float* const output = rows.data() + kRows * D;
  float row_max[kRows], row_sum[kRows];
  for (int64_t t = 0; t < nt; ++t)
    for (int g = 0; g < G; ++g) {
      const int64_t row = t * G + g;
      const pagedllm::bf16* q = c.query + (t0 + t) * c.heads * D + (head0 + g) * D;
      for (int d = 0; d < D; ++d) query[row * D + d] = pagedllm::Cvt<pagedllm::bf16>::load(q, d);
      std::fill_n(output + row * D, D, 0.f);
      row_max[row] = kMasked;
      row_sum[row] = 0.f;
    }
  alignas(32) float kt[D][kKeys];
  alignas(32) float values[kKeys][D];
  const __m256 lane_lo = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256 lane_hi = _mm256_add_ps(lane_lo, _mm256_set1_ps(8));
  for (int64_t gi = first_seen / kKeys; gi * kKeys <= last; ++gi) {
    const int64_t k0 = gi * kKeys;
    for (int k = 0; k < kKeys; ++k) {
      alignas(32) uint16_t key_row[D], value_row[D];
      const bool live = k0 + k <= last && k0 + k >= first_seen;
      if (fetch_key<cache_t, D>(c, key_rows, value_rows, k0 + k, live, key_row, value_row)) {
        for (int d = 0; d < D; ++d) {
          kt[d][k] = bf16_bits_to_float(key_row[d]);
          values[k][d] = bf16_bits_to_float(value_row[d]);
        }
      } else {
        for (int d = 0; d < D; ++d) kt[d][k] = values[k][d] = 0.f;
      }
    }
    for (int64_t t = 0; t < nt; ++t) {
      const int64_t position = c.start + t0 + t;
      const int64_t first = c.first_visible(position);
      if (k0 > position || k0 + kKeys <= first) continue;  // a group this token does not see
      const int visible = static_cast<int>(std::min<int64_t>(position - k0 + 1, kKeys));
      const int hidden = static_cast<int>(std::max<int64_t>(first - k0, 0));  // before the window
      // Keys after this token (and past the context), and before its window: probability 0.
      const __m256 lo = _mm256_set1_ps(static_cast<float>(hidden)), hi = _mm256_set1_ps(static_cast<float>(visible));
      const __m256 keep[2] = {
          _mm256_and_ps(_mm256_cmp_ps(lane_lo, lo, _CMP_GE_OQ), _mm256_cmp_ps(lane_lo, hi, _CMP_LT_OQ)),
          _mm256_and_ps(_mm256_cmp_ps(lane_hi, lo, _CMP_GE_OQ), _mm256_cmp_ps(lane_hi, hi, _CMP_LT_OQ))};
      const auto rows_of = [&](auto count, int g0) {
        constexpr int R = decltype(count)::value;
        const float* q[R];
        float* out[R];
        for (int r = 0; r < R; ++r) {
          q[r] = query + (t * G + g0 + r) * D;
          out[r] = output + (t * G + g0 + r) * D;
        }
        __m256 a[R][2];
        group_scores<D, R>(kt, q, a);
        alignas(32) float probs[R][kKeys];
        for (int r = 0; r < R; ++r)
          softmax_step<D>(a[r], keep, c.options, row_max[t * G + g0 + r], row_sum[t * G + g0 + r],
                          out[r], probs[r]);
        add_values<D, R>(values, probs, hidden, visible, out);
      };
      int g0 = 0;
      for (; g0 + 3 <= G; g0 += 3) rows_of(std::integral_constant<int, 3>{}, g0);
      if (G - g0 == 2) rows_of(std::integral_constant<int, 2>{}, g0);
      else if (G - g0 == 1) rows_of(std::integral_constant<int, 1>{}, g0);
    }
  }
  for (int64_t t = 0; t < nt; ++t)
    for (int g = 0; g < G; ++g) {
      const int64_t row = t * G + g;
      pagedllm::bf16* o = c.out + (t0 + t) * c.heads * D + (head0 + g) * D;
      const float inv = 1.f / row_sum[row];
      for (int d = 0; d < D; ++d) pagedllm::Cvt<pagedllm::bf16>::store(o, d, output[row * D + d] * inv);
    }
}

#endif  // __AVX512BF16__ / AVX2

#if defined(PAGEDLLM_TILED_PREFILL)

template <typename cache_t, int D, int G>
void run_tiles(const Chunk& c, int64_t tokens) {
  const int64_t tiles = (tokens + kTileTokens - 1) / kTileTokens;
  const int64_t group = c.heads / c.cache.kv_heads, parts = group / G;  // pagedllm::task_group
  const int64_t tasks = tiles * c.cache.kv_heads * parts;
  // One task at a time, longest (latest tile) first, so that the threads end together.
  const int threads = static_cast<int>(std::min<int64_t>(pagedllm::num_threads(), tasks));
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
  for (int64_t i = 0; i < tasks; ++i) {
    const int64_t task = tasks - 1 - i;
    const int64_t tile = task / (c.cache.kv_heads * parts), kv = task / parts % c.cache.kv_heads;
    const int64_t t0 = tile * kTileTokens;
    attend_tile<cache_t, D, G>(c, kv, kv * group + task % parts * G, t0,
                               std::min(kTileTokens, tokens - t0));
  }
}

#endif  // PAGEDLLM_TILED_PREFILL

}  // namespace

bool pagedllm::kernel::tiled_prefill_attention(DType dtype, const void* query, int64_t tokens,
                                               int64_t heads, const PagedCache& cache,
                                               const int64_t* table, int64_t start,
                                               const AttentionOptions& options, void* out) {
#if defined(PAGEDLLM_TILED_PREFILL)
  if (dtype != DType::BFloat16 || cache.head_dim % kTiledDims != 0) return false;
  if (tokens == 0) return true;  // nothing to attend (and no thread team of 0)
  const Chunk c{static_cast<const bf16*>(query), cache, table, static_cast<bf16*>(out), heads,
                start, options};
  pagedllm::dispatch_head_shape(cache.head_dim, heads / cache.kv_heads, [&](auto dim, auto group) {
    constexpr int D = decltype(dim)::value, G = decltype(group)::value;
    if constexpr (D % kTiledDims == 0) {  // checked above; no code for the other sizes
      if (cache.quantized) run_tiles<int8_t, D, G>(c, tokens);
      else run_tiles<bf16, D, G>(c, tokens);
    }
  });
  return true;
#else
  return false;
#endif
}
