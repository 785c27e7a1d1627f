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

// The group's scaled (and soft-capped) q.k over positions first .. len - 1 of one KV head,
// into scores [G][len - first].
template <typename scalar_t, typename cache_t, int HEAD_DIM, int GROUP>
void group_scores(const scalar_t* __restrict__ query, const HeadRows<cache_t>& keys,
                  const int64_t* __restrict__ table, int64_t first, int64_t len,
                  const AttentionOptions& options, float* __restrict__ scores) {
  constexpr int D = HEAD_DIM, G = GROUP;
  const float scale = options.scale;
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
    for (int64_t t = 0; t < G * (len - first); ++t) scores[t] = cap * std::tanh(scores[t] * inv_cap);
  }
}

// acc[g] += sum_t p[g][t] v_t over positions first .. len - 1 (p [G][len - first]).
template <typename scalar_t, typename cache_t, int HEAD_DIM, int GROUP>
void add_weighted_values(const HeadRows<cache_t>& values, const int64_t* __restrict__ table,
                         int64_t first, int64_t len, const float* __restrict__ p, float (&acc)[GROUP][HEAD_DIM]) {
  constexpr int D = HEAD_DIM, G = GROUP;
  const int64_t ctx = len - first;
  alignas(64) float row[D];
  for_each_block(values, table, first, len, D, [&](const cache_t* v, const float* vs, int64_t start, int64_t n) {
    for (int64_t j = 0; j < n; ++j, v += values.token_stride) {
      load_row<scalar_t, D>(v, row);
      const float row_scale = vs ? vs[j * values.kv_heads] : 1.f;  // int8: the row's scale
      for (int g = 0; g < G; ++g) {
        const float w = p[g * ctx + start + j] * row_scale;
        for (int d = 0; d < D; ++d) acc[g][d] += w * row[d];
      }
    }
  });
}

// One (sequence, KV head) task whose context is one part: the group's query heads attend over
// it. HEAD_DIM and GROUP as template constants let the compiler unroll the loops and keep the
// group's accumulators in vector registers; the context is walked block by block, so finding
// a token's slot needs no division. cache_t: scalar_t, or int8_t with per-row scales.
template <typename scalar_t, typename cache_t, int HEAD_DIM, int GROUP>
void attend(const scalar_t* __restrict__ query, const HeadRows<cache_t>& keys,
                   const HeadRows<cache_t>& values, const int64_t* __restrict__ table,
                   int64_t len, scalar_t* __restrict__ out, const AttentionOptions& options,
                   std::vector<float>& score_buffer) {
  constexpr int D = HEAD_DIM, G = GROUP;
  const int64_t first = options.first_visible(len), ctx = len - first;
  alignas(64) float acc[G][D];
  score_buffer.resize(static_cast<size_t>(G) * ctx);
  float* __restrict__ scores = score_buffer.data();
  group_scores<scalar_t, cache_t, D, G>(query, keys, table, first, len, options, scores);
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
  add_weighted_values<scalar_t, cache_t, D, G>(values, table, first, len, scores, acc);
  for (int g = 0; g < G; ++g)
    for (int d = 0; d < D; ++d) out[g * D + d] = static_cast<scalar_t>(acc[g][d]);
}

// A context longer than kPartTokens is split into parts of kPartTokens (the last shorter),
// each its own task, merged after by their maxima (as flash-decoding splits it): one
// sequence's attention then spreads over every thread instead of over its KV heads (the
// default model has 3; on a host with more cores than that the others sat idle). The parts
// follow from the sequence's own context only, so a row's result is the same whatever else
// shares its step and however many threads run it.
constexpr int64_t kPartTokens = 256;

inline int64_t context_parts(int64_t ctx) { return ctx > kPartTokens ? (ctx + kPartTokens - 1) / kPartTokens : 1; }

// One part's partial result: the group's weights taken against the part's own maximum m[g]
// and left unnormalised, their sum s[g], and acc[g] = sum p v.
template <int HEAD_DIM, int GROUP>
struct PartialAttention {
  float m[GROUP], s[GROUP];
  alignas(64) float acc[GROUP][HEAD_DIM];
};

template <typename scalar_t, typename cache_t, int HEAD_DIM, int GROUP>
void attend_part(const scalar_t* __restrict__ query, const HeadRows<cache_t>& keys,
                 const HeadRows<cache_t>& values, const int64_t* __restrict__ table, int64_t first,
                 int64_t len, const AttentionOptions& options, std::vector<float>& score_buffer,
                 PartialAttention<HEAD_DIM, GROUP>& part) {
  constexpr int D = HEAD_DIM, G = GROUP;
  const int64_t ctx = len - first;
  score_buffer.resize(static_cast<size_t>(G) * ctx);
  float* __restrict__ scores = score_buffer.data();
  group_scores<scalar_t, cache_t, D, G>(query, keys, table, first, len, options, scores);
  for (int g = 0; g < G; ++g) {
    float* sg = scores + g * ctx;
    float m = sg[0];
    for (int64_t t = 1; t < ctx; ++t) m = std::max(m, sg[t]);
    float sum = 0.f;
    for (int64_t t = 0; t < ctx; ++t) { sg[t] = std::exp(sg[t] - m); sum += sg[t]; }
    part.m[g] = m;
    part.s[g] = sum;
    for (int d = 0; d < D; ++d) part.acc[g][d] = 0.f;
  }
  add_weighted_values<scalar_t, cache_t, D, G>(values, table, first, len, scores, part.acc);
}

// The parts of one (sequence, KV head) in context order, merged: each rescaled by
// exp(m_i - max m), the sums the same way.
template <typename scalar_t, int HEAD_DIM, int GROUP>
void merge_parts(const PartialAttention<HEAD_DIM, GROUP>* parts, int64_t count, scalar_t* __restrict__ out) {
  constexpr int D = HEAD_DIM, G = GROUP;
  for (int g = 0; g < G; ++g) {
    float m = parts[0].m[g];
    for (int64_t i = 1; i < count; ++i) m = std::max(m, parts[i].m[g]);
    float sum = 0.f;
    alignas(64) float acc[D] = {};
    for (int64_t i = 0; i < count; ++i) {
      const float w = std::exp(parts[i].m[g] - m);
      sum += parts[i].s[g] * w;
      for (int d = 0; d < D; ++d) acc[d] += parts[i].acc[g][d] * w;
    }
    const float inv = 1.f / sum;
    for (int d = 0; d < D; ++d) out[g * D + d] = static_cast<scalar_t>(acc[d] * inv);
  }
}

template <typename scalar_t, typename cache_t, int HEAD_DIM, int GROUP>
void decode_kernel(const scalar_t* query, const PagedCache& cache, const int64_t* block_tables,
                          const int64_t* seq_lens, scalar_t* out, int64_t num_seqs,
                          int64_t num_heads, int64_t max_blocks, const AttentionOptions& options) {
  using Partial = PartialAttention<HEAD_DIM, GROUP>;
  const int64_t num_kv_heads = cache.kv_heads, group = num_heads / num_kv_heads;
  const int64_t parts = group / GROUP;  // query-head groups per KV head (pagedllm::task_group)
  const int64_t units_per_seq = num_kv_heads * parts;  // (KV head, group) units of a sequence
  // Per sequence, its first task and its first partial result (where its context splits).
  std::vector<int64_t> first_task(num_seqs + 1), first_partial(num_seqs + 1);
  for (int64_t seq = 0; seq < num_seqs; ++seq) {
    const int64_t len = seq_lens[seq], pieces = context_parts(len - options.first_visible(len));
    first_task[seq + 1] = first_task[seq] + units_per_seq * pieces;
    first_partial[seq + 1] = first_partial[seq] + (pieces > 1 ? units_per_seq * pieces : 0);
  }
  const int64_t tasks = first_task[num_seqs];
  std::vector<Partial> partials(static_cast<size_t>(first_partial[num_seqs]));
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
      const int64_t seq = std::upper_bound(first_task.begin(), first_task.end(), task) - first_task.begin() - 1;
      const int64_t local = task - first_task[seq], pieces = (first_task[seq + 1] - first_task[seq]) / units_per_seq;
      const int64_t unit = local / pieces, piece = local % pieces;
      const int64_t kv_head = unit / parts;
      const int64_t head0 = (seq * num_heads + kv_head * group + unit % parts * GROUP) * HEAD_DIM;
      const auto keys = cache.head_rows<cache_t>(cache.key, cache.key_scales, kv_head);
      const auto values = cache.head_rows<cache_t>(cache.value, cache.value_scales, kv_head);
      const int64_t* table = block_tables + seq * max_blocks;
      const int64_t len = seq_lens[seq];
      if (pieces == 1) {
        attend<scalar_t, cache_t, HEAD_DIM, GROUP>(query + head0, keys, values, table, len, out + head0,
                                                   options, scores);
      } else {
        const int64_t begin = options.first_visible(len) + piece * kPartTokens;
        attend_part<scalar_t, cache_t, HEAD_DIM, GROUP>(query + head0, keys, values, table, begin,
                                                        std::min(len, begin + kPartTokens), options, scores,
                                                        partials[first_partial[seq] + local]);
      }
    }
    // Each split (sequence, unit): its parts, in context order, into its output.
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < num_seqs * units_per_seq; ++i) {
      const int64_t seq = i / units_per_seq, unit = i % units_per_seq;
      const int64_t pieces = (first_task[seq + 1] - first_task[seq]) / units_per_seq;
      if (pieces == 1) continue;
      const int64_t head0 = (seq * num_heads + unit / parts * group + unit % parts * GROUP) * HEAD_DIM;
      merge_parts<scalar_t, HEAD_DIM, GROUP>(partials.data() + first_partial[seq] + unit * pieces, pieces,
                                             out + head0);
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
