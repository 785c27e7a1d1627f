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
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "attention_scores.h"
#include "dtype.h"
#include "ops.h"
#include "paged_cache.h"
#include "paged_rows.h"

// One (sequence, KV head) task: the group's query heads attend over the context. HEAD_DIM
// and GROUP as template constants let the compiler unroll the loops and keep the group's
// accumulators in vector registers; the context is walked block by block, so finding a
// token's slot needs no division. cache_t: scalar_t, or int8_t with per-row scales.
template <typename scalar_t, typename cache_t, int HEAD_DIM, int GROUP>
static void attend(const scalar_t* __restrict__ query, const HeadRows<cache_t>& keys,
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
    if constexpr (std::is_same_v<scalar_t, c10::BFloat16>)
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
static void decode_kernel(const scalar_t* query, const PagedCache& cache, const int64_t* block_tables,
                          const int64_t* seq_lens, scalar_t* out, int64_t num_seqs,
                          int64_t num_heads, int64_t max_blocks, const AttentionOptions& options) {
  const int64_t num_kv_heads = cache.kv_heads, group = num_heads / num_kv_heads;
  const int64_t parts = group / GROUP;  // tasks per KV head (pagedllm::task_group)
  const int64_t tasks = num_seqs * num_kv_heads * parts;
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
      const int64_t seq = task / (num_kv_heads * parts), kv_head = task / parts % num_kv_heads;
      const int64_t head0 = (seq * num_heads + kv_head * group + task % parts * GROUP) * HEAD_DIM;
      attend<scalar_t, cache_t, HEAD_DIM, GROUP>(
          query + head0, cache.head_rows<cache_t>(cache.key, cache.key_scales, kv_head),
          cache.head_rows<cache_t>(cache.value, cache.value_scales, kv_head),
          block_tables + seq * max_blocks, seq_lens[seq], out + head0, options, scores);
    }
  }
}

bool check_cache_pair(const torch::Tensor& key_cache, const torch::Tensor& value_cache,
                      const c10::optional<torch::Tensor>& key_scales,
                      const c10::optional<torch::Tensor>& value_scales, at::ScalarType dtype) {
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.is_contiguous() && value_cache.is_contiguous() &&
              value_cache.sizes() == key_cache.sizes(), "caches must be contiguous, 4-D and alike");
  TORCH_CHECK(value_cache.scalar_type() == key_cache.scalar_type(), "key and value cache dtypes differ");
  const bool quantized = key_cache.scalar_type() == torch::kInt8;
  TORCH_CHECK(quantized || key_cache.scalar_type() == dtype,
              "the cache must be int8 or in the activations' dtype");
  TORCH_CHECK(quantized == (key_scales.has_value() && value_scales.has_value()),
              "an int8 cache needs key and value scales; a float cache takes none");
  if (quantized)
    for (const auto* t : {&*key_scales, &*value_scales})
      TORCH_CHECK(t->scalar_type() == torch::kFloat && t->is_contiguous() &&
                  t->sizes() == key_cache.sizes().slice(0, 3),
                  "scales must be contiguous float32 [num_blocks, block_size, kv_heads]");
  return quantized;
}

PagedCache::PagedCache(const torch::Tensor& query, const torch::Tensor& key_cache,
                       const torch::Tensor& value_cache,
                       const c10::optional<torch::Tensor>& key_scale_tensor,
                       const c10::optional<torch::Tensor>& value_scale_tensor) {
  TORCH_CHECK(query.dim() == 3, "query must be [tokens, heads, head_dim]");
  TORCH_CHECK(query.scalar_type() == torch::kFloat || query.scalar_type() == torch::kBFloat16,
              "query must be float32 or bfloat16");
  quantized = check_cache_pair(key_cache, value_cache, key_scale_tensor, value_scale_tensor,
                               query.scalar_type());
  TORCH_CHECK(query.size(2) == key_cache.size(3), "query and cache head_dim differ");
  const int64_t num_heads = query.size(1);
  kv_heads = key_cache.size(2);
  TORCH_CHECK(num_heads % kv_heads == 0, "heads must be a multiple of KV heads");
  TORCH_CHECK(pagedllm::supported_head_dim(query.size(2)), "head_dim must be 64, 80, 96, 128 or 256");
  block_size = key_cache.size(1);
  head_dim = key_cache.size(3);
  key = key_cache.data_ptr();
  value = value_cache.data_ptr();
  if (quantized) {
    key_scales = key_scale_tensor->data_ptr<float>();
    value_scales = value_scale_tensor->data_ptr<float>();
  }
}

static AttentionOptions options(double scale, double softcap, int64_t window) {
  TORCH_CHECK(softcap >= 0.0 && window >= 0, "softcap and window must be >= 0 (0: none)");
  return {static_cast<float>(scale), static_cast<float>(softcap), window};
}

// The per-token kernel for the dtype, head_dim and group. tables: num_seqs rows of max_blocks
// block ids (max_blocks 0: every row the same table).
static torch::Tensor run_paged_attention(const torch::Tensor& query, const PagedCache& cache,
                                         const int64_t* tables, int64_t max_blocks,
                                         const int64_t* seq_lens, const AttentionOptions& options) {
  const int64_t num_seqs = query.size(0), num_heads = query.size(1);
  auto out = torch::empty_like(query);
  pagedllm::dispatch(query.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    pagedllm::dispatch_head_shape(cache.head_dim, num_heads / cache.kv_heads, [&](auto dim, auto group) {
      constexpr int D = decltype(dim)::value, G = decltype(group)::value;
      if (cache.quantized)
        decode_kernel<scalar_t, int8_t, D, G>(query.data_ptr<scalar_t>(), cache, tables, seq_lens,
                                              out.data_ptr<scalar_t>(), num_seqs, num_heads,
                                              max_blocks, options);
      else
        decode_kernel<scalar_t, scalar_t, D, G>(query.data_ptr<scalar_t>(), cache, tables, seq_lens,
                                                out.data_ptr<scalar_t>(), num_seqs, num_heads,
                                                max_blocks, options);
    });
  });
  return out;
}

// query [S, H, D]; caches [num_blocks, block_size, KVH, D] in the query's dtype, or int8 with
// float32 scales [num_blocks, block_size, KVH]; block_tables [S, max_blocks] int64; seq_lens
// [S] int64. Returns [S, H, D] in the query dtype.
torch::Tensor paged_decode_attention(torch::Tensor query, torch::Tensor key_cache,
                                     torch::Tensor value_cache, torch::Tensor block_tables,
                                     torch::Tensor seq_lens, double scale,
                                     c10::optional<torch::Tensor> key_scales,
                                     c10::optional<torch::Tensor> value_scales, double softcap,
                                     int64_t window) {
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt64 && seq_lens.scalar_type() == torch::kInt64,
              "block_tables and seq_lens must be int64");
  block_tables = block_tables.contiguous();
  seq_lens = seq_lens.contiguous();
  query = query.contiguous();
  const PagedCache cache(query, key_cache, value_cache, key_scales, value_scales);
  return run_paged_attention(query, cache, block_tables.data_ptr<int64_t>(), block_tables.size(1),
                             seq_lens.data_ptr<int64_t>(), options(scale, softcap, window));
}

// Prefill chunk of one sequence: query [T, H, D] holds the tokens at positions start..start+T-1,
// whose K/V are already in the cache; each attends causally to positions <= its own. bfloat16
// chunks take the tiled kernel (prefill_attention.cpp) in the avx512 build; otherwise
// each token is a one-query "sequence" over the same table, with its own length, and tasks
// (token, KV head) are handed out dynamically, longest first, since later tokens see longer
// contexts.
torch::Tensor paged_prefill_attention(torch::Tensor query, torch::Tensor key_cache,
                                      torch::Tensor value_cache, torch::Tensor block_table,
                                      int64_t start, double scale,
                                      c10::optional<torch::Tensor> key_scales,
                                      c10::optional<torch::Tensor> value_scales, double softcap,
                                      int64_t window) {
  TORCH_CHECK(block_table.scalar_type() == torch::kInt64 && block_table.dim() == 1,
              "block_table must be 1-D int64");
  TORCH_CHECK(query.dim() == 3 && key_cache.dim() == 4, "bad shapes");
  block_table = block_table.contiguous();
  const int64_t tokens = query.size(0);
  TORCH_CHECK(start >= 0 && start + tokens <= block_table.size(0) * key_cache.size(1),
              "the chunk runs past its block table");
  query = query.contiguous();
  const PagedCache cache(query, key_cache, value_cache, key_scales, value_scales);
  const AttentionOptions opts = options(scale, softcap, window);
  if (auto tiled = tiled_prefill_attention(query, cache, block_table, start, opts))
    return *tiled;
  auto lens = torch::arange(start + 1, start + tokens + 1, block_table.options());
  return run_paged_attention(query, cache, block_table.data_ptr<int64_t>(), /*max_blocks=*/0,
                             lens.data_ptr<int64_t>(), opts);
}
