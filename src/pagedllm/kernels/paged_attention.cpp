// Paged attention straight from the block-paged cache: decode tokens (one query per
// sequence) and prefill chunks (each token over its causal context) share one per-token
// path, with no gather copy and one pass over the context per KV head, shared by the query
// heads of its group (GQA). Math in float32 whatever the cache dtype; the q.k scores come
// from attention_scores.h, which uses the instructions of the build's CPU level
// (benchmarks/attention_kernels.py: 12x the torch gather path at 16 sequences x 600 tokens).
// int8 caches (paged_cache.h) hold half the bytes: q.k multiplies the key codes by the
// query rounded to int8, p.v folds each row's scale into its weight. AttentionOptions add
// what Gemma and Mistral ask: a query scale of their own, soft-capped scores
// (cap * tanh(s / cap)) and a sliding window (a token sees the last `window` positions).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "attention_scores.h"
#include "dtype.h"
#include "kernels.h"
#include "paged_cache.h"
#include "paged_rows.h"

namespace {

// One (sequence, KV head) task: the group's query heads attend over the context. HEAD_DIM
// and GROUP as template constants let the compiler unroll the loops and keep the group's
// accumulators in vector registers; the context is walked block by block, so finding a
// token's slot needs no division. cache_t: scalar_t, or int8_t with per-row scales.
template <typename scalar_t, typename cache_t, int HEAD_DIM, int GROUP>
void attend(const scalar_t* __restrict__ query, const HeadRows<cache_t>& keys,
                   const HeadRows<cache_t>& values, const int64_t* __restrict__ table,
                   int64_t len, scalar_t* __restrict__ out, const AttentionOptions& options,
                   std::vector<float>& score_buffer) {
  constexpr int D = HEAD_DIM, G = GROUP;
  const int64_t first = options.first_visible(len), ctx = len - first;
  const float scale = options.scale;
  alignas(64) float acc[G][D];
  score_buffer.resize(static_cast<size_t>(G) * ctx);
  float* __restrict__ scores = score_buffer.data();
  if constexpr (std::is_same_v<cache_t, int8_t>) {
    qk_scores_int8<scalar_t, D, G>(query, keys, table, first, len, scale, scores);
  } else {
#if defined(__AVX512BF16__)
    if constexpr (std::is_same_v<scalar_t, pagedllm::bf16>)
      qk_scores_bf16<D, G>(query, keys, table, first, len, scale, scores);
    else
#endif
      qk_scores_generic<scalar_t, D, G>(query, keys, table, first, len, scale, scores);
  }
  if (options.softcap > 0.f) {
    const float cap = options.softcap, inv_cap = 1.f / options.softcap;
    for (int64_t t = 0; t < G * ctx; ++t) scores[t] = cap * std::tanh(scores[t] * inv_cap);
  }
  for (int g = 0; g < G; ++g) {
    float* sg = scores + g * ctx;
    float m = sg[0];
    for (int64_t t = 1; t < ctx; ++t) m = std::max(m, sg[t]);
    float sum = 0.f;
    for (int64_t t = 0; t < ctx; ++t) { sg[t] = std::exp(sg[t] - m); sum += sg[t]; }
    const float inv = 1.f / sum;
    for (int64_t t = 0; t < ctx; ++t) sg[t] *= inv;
    for (int d = 0; d < D; ++d) acc[g][d] = 0.f;
  }
  alignas(64) float row[D];
  for_each_block(values, table, first, len, D, [&](const cache_t* v, const float* vs, int64_t start, int64_t n) {
    for (int64_t j = 0; j < n; ++j, v += values.token_stride) {
      load_row<scalar_t, D>(v, row);
      const float row_scale = vs ? vs[j * values.kv_heads] : 1.f;  // int8: the row's scale
      for (int g = 0; g < G; ++g) {
        const float p = scores[g * ctx + start + j] * row_scale;
        for (int d = 0; d < D; ++d) acc[g][d] += p * row[d];
      }
    }
  });
  for (int g = 0; g < G; ++g)
    for (int d = 0; d < D; ++d) out[g * D + d] = static_cast<scalar_t>(acc[g][d]);
}

template <typename scalar_t, typename cache_t, int HEAD_DIM, int GROUP>
void decode_kernel(const scalar_t* query, const PagedCache& cache, const int64_t* block_tables,
                          const int64_t* seq_lens, scalar_t* out, int64_t num_seqs,
                          int64_t num_heads, int64_t max_blocks, const AttentionOptions& options) {
  const int64_t num_kv_heads = cache.kv_heads, group = num_heads / num_kv_heads;
  const int64_t parts = group / GROUP;  // tasks per KV head (pagedllm::task_group)
  const int64_t tasks = num_seqs * num_kv_heads * parts;
  // Tasks handed out one at a time, last first: in a prefill chunk the last tokens have the
  // longest contexts, and starting with them balances the threads (a static split gave one
  // thread 3x the work of the other).
  const int threads = static_cast<int>(std::min<int64_t>(pagedllm::num_threads(), tasks));
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> scores;
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < tasks; ++i) {
      const int64_t task = tasks - 1 - i;
      const int64_t seq = task / (num_kv_heads * parts), kv_head = task / parts % num_kv_heads;
      const int64_t head0 = (seq * num_heads + kv_head * group + task % parts * GROUP) * HEAD_DIM;
      attend<scalar_t, cache_t, HEAD_DIM, GROUP>(
          query + head0, cache.head_rows<cache_t>(cache.key, cache.key_scales, kv_head),
          cache.head_rows<cache_t>(cache.value, cache.value_scales, kv_head),
          block_tables + seq * max_blocks, seq_lens[seq], out + head0, options, scores);
    }
  }
}

}  // namespace

namespace pagedllm::kernel {

// The per-token kernel for the dtype, head_dim and group.
void paged_attention(DType dtype, const void* query, const PagedCache& cache,
                     const int64_t* tables, int64_t max_blocks, const int64_t* seq_lens,
                     void* out, int64_t num_seqs, int64_t num_heads, const AttentionOptions& options) {
  pagedllm::dispatch(dtype, [&](auto tag) {
    using scalar_t = decltype(tag);
    const auto* q = static_cast<const scalar_t*>(query);
    auto* o = static_cast<scalar_t*>(out);
    pagedllm::dispatch_head_shape(cache.head_dim, num_heads / cache.kv_heads, [&](auto dim, auto group) {
      constexpr int D = decltype(dim)::value, G = decltype(group)::value;
      if (cache.quantized)
        decode_kernel<scalar_t, int8_t, D, G>(q, cache, tables, seq_lens, o, num_seqs, num_heads,
                                              max_blocks, options);
      else
        decode_kernel<scalar_t, scalar_t, D, G>(q, cache, tables, seq_lens, o, num_seqs, num_heads,
                                                max_blocks, options);
    });
  });
}

}  // namespace pagedllm::kernel
