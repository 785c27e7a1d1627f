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
#include "kernels.h"
#include "paged_cache.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <new>
#include <vector>

#include "dtype.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {

using pagedllm::bf16;
using pagedllm::DType;

constexpr int64_t kTileTokens = 16;  // query tokens per task
constexpr int kKeys = 16;            // keys per step: one float32 vector of scores
// A finite "minus infinity": the kernels build with -ffast-math, which assumes no infinities.
constexpr float kMasked = -1e30f;

#if defined(__AVX512BF16__)

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

// e^x for 16 floats, inline: a call per vector to the vectorised libm took ~40 % of the
// kernel. x = n ln2 + r with |r| <= ln2 / 2, e^r by its Taylor polynomial to r^7
// (relative error under 7.4e-8 over [-87, 0], checked against double exp), then scaled by
// 2^n; x below -87 (masked keys) gives exactly 0.
inline __m512 exp512(__m512 x) {
  const __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_GE_OQ);
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x);  // ln2, high bits
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), r);         // ln2, the rest
  __m512 p = _mm512_set1_ps(1.0f / 5040);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_maskz_scalef_ps(live, p, n);
}

// tanh for 16 floats, from exp512: (e^2x - 1) / (e^2x + 1), x clamped to +-9 where tanh is
// 1 to float precision (and e^2x stays finite).
inline __m512 tanh512(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-9.f)), _mm512_set1_ps(9.f));
  const __m512 e = exp512(_mm512_add_ps(x, x));
  return _mm512_div_ps(_mm512_sub_ps(e, _mm512_set1_ps(1.f)), _mm512_add_ps(e, _mm512_set1_ps(1.f)));
}

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
      // Keys before the window are laid out as zeros, like those past the context: their
      // blocks may be back in the pool, and a weight of 0 times NaN is still NaN.
      if (k < nk && k0 + k >= first_seen) {
        const int64_t pos = k0 + k;
        const int64_t block_size = c.cache.block_size;
        const int64_t slot = c.table[pos / block_size] * block_size + pos % block_size;
        alignas(64) uint16_t key_row[D];
        fetch_row<D>(key_rows.cache + slot * key_rows.token_stride,
                     key_rows.scales ? key_rows.scales + slot * key_rows.kv_heads : nullptr, key_row);
        uint32_t pairs[P];
        std::memcpy(pairs, key_row, sizeof(pairs));
        for (int p = 0; p < P; ++p) kg.kt[p][k] = pairs[p];
        fetch_row<D>(value_rows.cache + slot * value_rows.token_stride,
                     value_rows.scales ? value_rows.scales + slot * value_rows.kv_heads : nullptr,
                     values[k]);
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

#endif  // __AVX512BF16__

}  // namespace

bool pagedllm::kernel::tiled_prefill_attention(DType dtype, const void* query, int64_t tokens,
                                               int64_t heads, const PagedCache& cache,
                                               const int64_t* table, int64_t start,
                                               const AttentionOptions& options, void* out) {
#if defined(__AVX512BF16__)
  if (dtype != DType::BFloat16 || cache.head_dim % 32 != 0) return false;
  if (tokens == 0) return true;  // nothing to attend (and no thread team of 0)
  const Chunk c{static_cast<const bf16*>(query), cache, table, static_cast<bf16*>(out), heads,
                start, options};
  pagedllm::dispatch_head_shape(cache.head_dim, heads / cache.kv_heads, [&](auto dim, auto group) {
    constexpr int D = decltype(dim)::value, G = decltype(group)::value;
    if constexpr (D % 32 == 0) {  // checked above; no code for the other sizes
      if (cache.quantized) run_tiles<int8_t, D, G>(c, tokens);
      else run_tiles<bf16, D, G>(c, tokens);
    }
  });
  return true;
#else
  return false;
#endif
}
