// Paged attention straight from the block-paged cache: decode tokens (one query per
// sequence) and prefill chunks (each token over its causal context) share one per-token
// path, with no gather copy and one pass over the context per KV head, shared by the query
// heads of its group (GQA). Math in float32 whatever the cache dtype; for bfloat16 caches on
// CPUs with AVX512-BF16 the q.k products use its dot-product instruction
// (benchmarks/attention_kernels.py: 25x the torch gather path at 16 sequences x 600 tokens).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "dtype.h"
#include "ops.h"

using pagedllm::Cvt;

template <typename scalar_t, int D>
static inline void load_row(const scalar_t* __restrict__ src, float* __restrict__ dst) {
  for (int d = 0; d < D; ++d) dst[d] = Cvt<scalar_t>::load(src, d);
}

// Asks for the rows of one KV head a few blocks ahead while this block is computed: blocks
// are scattered, so the hardware prefetcher cannot guess them (1.15-1.3x on the decode
// kernel one block ahead; two ahead took 8 sequences x 600 tokens from 4.99 to 4.36 ms,
// benchmarks/attention_kernels.py, since 110 MB of K/V come from memory, not cache).
constexpr int64_t kPrefetchAhead = 2;

template <typename scalar_t>
static inline void prefetch_block(const scalar_t* block, int64_t block_size, int64_t token_stride,
                                  int64_t head_dim) {
  const char* base = reinterpret_cast<const char*>(block);
  const int64_t row_bytes = head_dim * static_cast<int64_t>(sizeof(scalar_t));
  for (int64_t r = 0; r < block_size; ++r)
    for (int64_t c = 0; c < row_bytes; c += 64)
      __builtin_prefetch(base + (r * token_stride) * static_cast<int64_t>(sizeof(scalar_t)) + c);
}

// Walks one KV head's context block by block: fn(rows, start, n) gets the block's first row
// (the next rows token_stride apart), that row's position and how many of the block's rows
// are in the context, while the rows kPrefetchAhead blocks ahead are asked for.
template <typename scalar_t, typename Fn>
static inline void for_each_block(const scalar_t* cache, const int64_t* table, int64_t len,
                                  int64_t block_size, int64_t token_stride, int64_t head_dim,
                                  const Fn& fn) {
  const int64_t block_stride = block_size * token_stride;
  for (int64_t start = 0, b = 0; start < len; start += block_size, ++b) {
    if (start + kPrefetchAhead * block_size < len)
      prefetch_block(cache + table[b + kPrefetchAhead] * block_stride, block_size, token_stride, head_dim);
    fn(cache + table[b] * block_stride, start, std::min(block_size, len - start));
  }
}

#if defined(__AVX512BF16__)
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

// q.k for bfloat16 caches with the AVX512-BF16 dot-product instruction: bf16 pairs multiplied
// exactly and summed in float32, four tokens at a time. scores [G][len], scaled.
template <int D, int G>
static void qk_scores_bf16(const c10::BFloat16* query, const c10::BFloat16* key_cache,
                           const int64_t* table, int64_t len, int64_t token_stride,
                           int64_t block_size, float scale, float* scores) {
  constexpr int V = D / 32;  // 512-bit vectors per row
  __m512bh q[G][V];
  for (int g = 0; g < G; ++g)
    for (int v = 0; v < V; ++v)
      q[g][v] = (__m512bh)_mm512_loadu_si512(query + g * D + v * 32);
  for_each_block(key_cache, table, len, block_size, token_stride, D,
                 [&](const c10::BFloat16* k, int64_t start, int64_t n) {
    int64_t j = 0;
    for (; j + 4 <= n; j += 4) {
      __m512bh rows[4][V];
      for (int r = 0; r < 4; ++r)
        for (int v = 0; v < V; ++v)
          rows[r][v] = (__m512bh)_mm512_loadu_si512(k + (j + r) * token_stride + v * 32);
      for (int g = 0; g < G; ++g) {
        __m512 acc[4];
        for (int r = 0; r < 4; ++r) {
          acc[r] = _mm512_dpbf16_ps(_mm512_setzero_ps(), q[g][0], rows[r][0]);
          for (int v = 1; v < V; ++v) acc[r] = _mm512_dpbf16_ps(acc[r], q[g][v], rows[r][v]);
        }
        const __m128 s = _mm_mul_ps(reduce4(acc[0], acc[1], acc[2], acc[3]), _mm_set1_ps(scale));
        _mm_storeu_ps(scores + g * len + start + j, s);
      }
    }
    for (; j < n; ++j) {
      for (int g = 0; g < G; ++g) {
        __m512 acc = _mm512_setzero_ps();
        for (int v = 0; v < V; ++v)
          acc = _mm512_dpbf16_ps(acc, q[g][v], (__m512bh)_mm512_loadu_si512(k + j * token_stride + v * 32));
        scores[g * len + start + j] = _mm512_reduce_add_ps(acc) * scale;
      }
    }
  });
}
#endif

// q.k for any cache dtype, widened to float32. scores [G][len], scaled.
template <typename scalar_t, int D, int G>
static void qk_scores_generic(const scalar_t* __restrict__ query,
                              const scalar_t* __restrict__ key_cache,
                              const int64_t* __restrict__ table, int64_t len, int64_t token_stride,
                              int64_t block_size, float scale, float* __restrict__ scores) {
  alignas(64) float q[G][D];
  alignas(64) float row[D];
  for (int g = 0; g < G; ++g)
    for (int d = 0; d < D; ++d) q[g][d] = Cvt<scalar_t>::load(query, g * D + d) * scale;
  for_each_block(key_cache, table, len, block_size, token_stride, D,
                 [&](const scalar_t* k, int64_t start, int64_t n) {
    for (int64_t j = 0; j < n; ++j, k += token_stride) {
      load_row<scalar_t, D>(k, row);
      for (int g = 0; g < G; ++g) {
        float s = 0.f;
        for (int d = 0; d < D; ++d) s += q[g][d] * row[d];
        scores[g * len + start + j] = s;
      }
    }
  });
}

// One (sequence, KV head) task: the group's query heads attend over the context. HEAD_DIM
// and GROUP as template constants let the compiler unroll the loops and keep the group's
// accumulators in vector registers; the context is walked block by block, so finding a
// token's slot needs no division.
template <typename scalar_t, int HEAD_DIM, int GROUP>
static void attend(const scalar_t* __restrict__ query, const scalar_t* __restrict__ key_cache,
                   const scalar_t* __restrict__ value_cache, const int64_t* __restrict__ table,
                   int64_t len, scalar_t* __restrict__ out, int64_t token_stride,
                   int64_t block_size, float scale, std::vector<float>& score_buffer) {
  constexpr int D = HEAD_DIM, G = GROUP;
  alignas(64) float acc[G][D];
  alignas(64) float row[D];
  score_buffer.resize(static_cast<size_t>(G) * len);
  float* __restrict__ scores = score_buffer.data();
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>)
    qk_scores_bf16<D, G>(query, key_cache, table, len, token_stride, block_size, scale, scores);
  else
#endif
    qk_scores_generic<scalar_t, D, G>(query, key_cache, table, len, token_stride, block_size,
                                      scale, scores);
  for (int g = 0; g < G; ++g) {
    float* sg = scores + g * len;
    float m = sg[0];
    for (int64_t t = 1; t < len; ++t) m = std::max(m, sg[t]);
    float sum = 0.f;
    for (int64_t t = 0; t < len; ++t) { sg[t] = std::exp(sg[t] - m); sum += sg[t]; }
    const float inv = 1.f / sum;
    for (int64_t t = 0; t < len; ++t) sg[t] *= inv;
    for (int d = 0; d < D; ++d) acc[g][d] = 0.f;
  }
  for_each_block(value_cache, table, len, block_size, token_stride, D,
                 [&](const scalar_t* v, int64_t start, int64_t n) {
    for (int64_t j = 0; j < n; ++j, v += token_stride) {
      load_row<scalar_t, D>(v, row);
      for (int g = 0; g < G; ++g) {
        const float p = scores[g * len + start + j];
        for (int d = 0; d < D; ++d) acc[g][d] += p * row[d];
      }
    }
  });
  for (int g = 0; g < G; ++g)
    for (int d = 0; d < D; ++d) out[g * D + d] = static_cast<scalar_t>(acc[g][d]);
}

template <typename scalar_t, int HEAD_DIM, int GROUP>
static void decode_kernel(const scalar_t* query, const scalar_t* key_cache,
                          const scalar_t* value_cache, const int64_t* block_tables,
                          const int64_t* seq_lens, scalar_t* out, int64_t num_seqs,
                          int64_t num_heads, int64_t num_kv_heads, int64_t block_size,
                          int64_t max_blocks, float scale) {
  const int64_t token_stride = num_kv_heads * HEAD_DIM;  // one slot of the cache
  const int64_t tasks = num_seqs * num_kv_heads;
  // Tasks handed out one at a time, last first: in a prefill chunk the last tokens have the
  // longest contexts, and starting with them balances the threads (a static split gave one
  // thread 3x the work of the other).
  const int threads = static_cast<int>(std::min<int64_t>(at::get_num_threads(), tasks));
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> scores;
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < tasks; ++i) {
      const int64_t task = tasks - 1 - i;
      const int64_t seq = task / num_kv_heads, kv_head = task % num_kv_heads;
      const int64_t head0 = (seq * num_heads + kv_head * GROUP) * HEAD_DIM;
      attend<scalar_t, HEAD_DIM, GROUP>(query + head0, key_cache + kv_head * HEAD_DIM,
                                        value_cache + kv_head * HEAD_DIM,
                                        block_tables + seq * max_blocks, seq_lens[seq],
                                        out + head0, token_stride, block_size, scale, scores);
    }
  }
}

// Checks shared by both entry points; returns the query, contiguous.
static torch::Tensor checked_query(const torch::Tensor& query, const torch::Tensor& key_cache,
                                   const torch::Tensor& value_cache) {
  TORCH_CHECK(query.dim() == 3 && key_cache.dim() == 4, "bad shapes");
  TORCH_CHECK(query.scalar_type() == key_cache.scalar_type() &&
              value_cache.scalar_type() == key_cache.scalar_type(), "query and cache dtypes differ");
  TORCH_CHECK(query.scalar_type() == torch::kFloat || query.scalar_type() == torch::kBFloat16,
              "query and cache must be float32 or bfloat16");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(value_cache.sizes() == key_cache.sizes() && query.size(2) == key_cache.size(3),
              "query, key and value shapes differ");
  const int64_t num_heads = query.size(1), num_kv_heads = key_cache.size(2);
  TORCH_CHECK(num_heads % num_kv_heads == 0 && num_heads / num_kv_heads <= 8,
              "heads must be a multiple of KV heads, at most 8 per group");
  TORCH_CHECK(query.size(2) == 64 || query.size(2) == 128, "head_dim must be 64 or 128");
  return query.contiguous();
}

// The per-token kernel for the dtype, head_dim and group. tables: num_seqs rows of max_blocks
// block ids (max_blocks 0: every row the same table).
static torch::Tensor run_paged_attention(torch::Tensor query, const torch::Tensor& key_cache,
                                         const torch::Tensor& value_cache, const int64_t* tables,
                                         int64_t max_blocks, const int64_t* seq_lens,
                                         double scale) {
  query = checked_query(query, key_cache, value_cache);
  const int64_t num_seqs = query.size(0), num_heads = query.size(1), head_dim = query.size(2);
  const int64_t block_size = key_cache.size(1), num_kv_heads = key_cache.size(2);
  auto out = torch::empty_like(query);
  pagedllm::dispatch(query.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    pagedllm::dispatch_head_shape(head_dim, num_heads / num_kv_heads, [&](auto dim, auto group) {
      decode_kernel<scalar_t, decltype(dim)::value, decltype(group)::value>(
          query.data_ptr<scalar_t>(), key_cache.data_ptr<scalar_t>(), value_cache.data_ptr<scalar_t>(),
          tables, seq_lens, out.data_ptr<scalar_t>(), num_seqs, num_heads, num_kv_heads, block_size,
          max_blocks, static_cast<float>(scale));
    });
  });
  return out;
}

// query [S, H, D]; caches [num_blocks, block_size, KVH, D]; block_tables [S, max_blocks] int64;
// seq_lens [S] int64. Returns [S, H, D] in the query dtype.
torch::Tensor paged_decode_attention(torch::Tensor query, torch::Tensor key_cache,
                                     torch::Tensor value_cache, torch::Tensor block_tables,
                                     torch::Tensor seq_lens, double scale) {
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt64 && seq_lens.scalar_type() == torch::kInt64,
              "block_tables and seq_lens must be int64");
  block_tables = block_tables.contiguous();
  seq_lens = seq_lens.contiguous();
  return run_paged_attention(query, key_cache, value_cache, block_tables.data_ptr<int64_t>(),
                             block_tables.size(1), seq_lens.data_ptr<int64_t>(), scale);
}

// Prefill chunk of one sequence: query [T, H, D] holds the tokens at positions start..start+T-1,
// whose K/V are already in the cache; each attends causally to positions <= its own. bfloat16
// chunks take the tiled kernel (prefill_attention.cpp) where AVX512-BF16 is built; otherwise
// each token is a one-query "sequence" over the same table, with its own length, and tasks
// (token, KV head) are handed out dynamically, longest first, since later tokens see longer
// contexts.
torch::Tensor paged_prefill_attention(torch::Tensor query, torch::Tensor key_cache,
                                      torch::Tensor value_cache, torch::Tensor block_table,
                                      int64_t start, double scale) {
  TORCH_CHECK(block_table.scalar_type() == torch::kInt64 && block_table.dim() == 1,
              "block_table must be 1-D int64");
  TORCH_CHECK(query.dim() == 3 && key_cache.dim() == 4, "bad shapes");
  block_table = block_table.contiguous();
  const int64_t tokens = query.size(0);
  TORCH_CHECK(start >= 0 && start + tokens <= block_table.size(0) * key_cache.size(1),
              "the chunk runs past its block table");
  query = checked_query(query, key_cache, value_cache);
  if (auto tiled = tiled_prefill_attention(query, key_cache, value_cache, block_table, start, scale))
    return *tiled;
  auto lens = torch::arange(start + 1, start + tokens + 1, block_table.options());
  return run_paged_attention(query, key_cache, value_cache, block_table.data_ptr<int64_t>(),
                             /*max_blocks=*/0, lens.data_ptr<int64_t>(), scale);
}
