// Paged attention for decode tokens (one query per sequence), reading K/V straight from the
// block-paged cache: no gather copy, one pass over each sequence's context per KV head,
// shared by the query heads of its group (GQA). Math in float32 whatever the cache dtype.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <limits>
#include <cstdint>
#include <type_traits>
#include <vector>

// Row loads into float32. The bfloat16 case is a plain 16-bit shift, written so the
// compiler vectorises it (c10's scalar conversion does not).
template <typename scalar_t, int D>
static inline void load_row(const scalar_t* __restrict__ src, float* __restrict__ dst) {
  for (int d = 0; d < D; ++d) dst[d] = static_cast<float>(src[d]);
}

template <>
inline void load_row<c10::BFloat16, 64>(const c10::BFloat16* __restrict__ src, float* __restrict__ dst) {
  const uint16_t* __restrict__ raw = reinterpret_cast<const uint16_t*>(src);
  uint32_t* __restrict__ out = reinterpret_cast<uint32_t*>(dst);
  for (int d = 0; d < 64; ++d) out[d] = static_cast<uint32_t>(raw[d]) << 16;
}

template <>
inline void load_row<c10::BFloat16, 128>(const c10::BFloat16* __restrict__ src, float* __restrict__ dst) {
  const uint16_t* __restrict__ raw = reinterpret_cast<const uint16_t*>(src);
  uint32_t* __restrict__ out = reinterpret_cast<uint32_t*>(dst);
  for (int d = 0; d < 128; ++d) out[d] = static_cast<uint32_t>(raw[d]) << 16;
}

// One (sequence, KV head) task: the group's query heads attend over the context.
// HEAD_DIM as a template constant lets the compiler unroll and vectorise the inner loops.
template <typename scalar_t, int HEAD_DIM>
static void attend(const scalar_t* __restrict__ query, const scalar_t* __restrict__ key_cache,
                   const scalar_t* __restrict__ value_cache, const int64_t* __restrict__ table,
                   int64_t len, scalar_t* __restrict__ out, int64_t group, int64_t token_stride,
                   int64_t block_size, float scale, std::vector<float>& scores) {
  constexpr int D = HEAD_DIM;
  alignas(64) float q[8][D];
  alignas(64) float acc[8][D];
  alignas(64) float row[D];
  for (int64_t g = 0; g < group; ++g)
    for (int d = 0; d < D; ++d) q[g][d] = static_cast<float>(query[g * D + d]) * scale;
  scores.resize(group * len);
  for (int64_t t = 0; t < len; ++t) {
    const scalar_t* __restrict__ k = key_cache + (table[t / block_size] * block_size + t % block_size) * token_stride;
    load_row<scalar_t, D>(k, row);
    for (int64_t g = 0; g < group; ++g) {
      float s = 0.f;
      for (int d = 0; d < D; ++d) s += q[g][d] * row[d];
      scores[g * len + t] = s;
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    float* sg = scores.data() + g * len;
    float m = sg[0];
    for (int64_t t = 1; t < len; ++t) m = std::max(m, sg[t]);
    float sum = 0.f;
    for (int64_t t = 0; t < len; ++t) { sg[t] = std::exp(sg[t] - m); sum += sg[t]; }
    const float inv = 1.f / sum;
    for (int64_t t = 0; t < len; ++t) sg[t] *= inv;
    for (int d = 0; d < D; ++d) acc[g][d] = 0.f;
  }
  for (int64_t t = 0; t < len; ++t) {
    const scalar_t* __restrict__ v = value_cache + (table[t / block_size] * block_size + t % block_size) * token_stride;
    load_row<scalar_t, D>(v, row);
    for (int64_t g = 0; g < group; ++g) {
      const float p = scores[g * len + t];
      for (int d = 0; d < D; ++d) acc[g][d] += p * row[d];
    }
  }
  for (int64_t g = 0; g < group; ++g)
    for (int d = 0; d < D; ++d) out[g * D + d] = static_cast<scalar_t>(acc[g][d]);
}

template <typename scalar_t, int HEAD_DIM>
static void decode_kernel(const scalar_t* query, const scalar_t* key_cache,
                          const scalar_t* value_cache, const int64_t* block_tables,
                          const int64_t* seq_lens, scalar_t* out, int64_t num_seqs,
                          int64_t num_heads, int64_t num_kv_heads, int64_t block_size,
                          int64_t max_blocks, float scale) {
  const int64_t group = num_heads / num_kv_heads;
  const int64_t token_stride = num_kv_heads * HEAD_DIM;  // one slot of the cache
  at::parallel_for(0, num_seqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t seq = task / num_kv_heads, kv_head = task % num_kv_heads;
      const int64_t head0 = (seq * num_heads + kv_head * group) * HEAD_DIM;
      attend<scalar_t, HEAD_DIM>(query + head0, key_cache + kv_head * HEAD_DIM,
                                 value_cache + kv_head * HEAD_DIM, block_tables + seq * max_blocks,
                                 seq_lens[seq], out + head0, group, token_stride, block_size,
                                 scale, scores);
    }
  });
}

// query [S, H, D]; caches [num_blocks, block_size, KVH, D]; block_tables [S, max_blocks] int64;
// seq_lens [S] int64. Returns [S, H, D] in the query dtype.
torch::Tensor paged_decode_attention(torch::Tensor query, torch::Tensor key_cache,
                                     torch::Tensor value_cache, torch::Tensor block_tables,
                                     torch::Tensor seq_lens, double scale) {
  TORCH_CHECK(query.dim() == 3 && key_cache.dim() == 4, "bad shapes");
  TORCH_CHECK(query.scalar_type() == key_cache.scalar_type(), "query and cache dtypes differ");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt64 && seq_lens.scalar_type() == torch::kInt64,
              "block_tables and seq_lens must be int64");
  query = query.contiguous();
  block_tables = block_tables.contiguous();
  seq_lens = seq_lens.contiguous();
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "caches must be contiguous");
  auto out = torch::empty_like(query);
  const int64_t num_seqs = query.size(0), num_heads = query.size(1), head_dim = query.size(2);
  const int64_t block_size = key_cache.size(1), num_kv_heads = key_cache.size(2);
  TORCH_CHECK(num_heads % num_kv_heads == 0 && num_heads / num_kv_heads <= 8,
              "heads must be a multiple of KV heads, at most 8 per group");
  TORCH_CHECK(head_dim == 64 || head_dim == 128, "head_dim must be 64 or 128");
  AT_DISPATCH_FLOATING_TYPES_AND(at::ScalarType::BFloat16, query.scalar_type(), "paged_decode", [&] {
    auto run = [&](auto dim_tag) {
      constexpr int D = decltype(dim_tag)::value;
      decode_kernel<scalar_t, D>(query.data_ptr<scalar_t>(), key_cache.data_ptr<scalar_t>(),
                                 value_cache.data_ptr<scalar_t>(), block_tables.data_ptr<int64_t>(),
                                 seq_lens.data_ptr<int64_t>(), out.data_ptr<scalar_t>(), num_seqs,
                                 num_heads, num_kv_heads, block_size, block_tables.size(1),
                                 static_cast<float>(scale));
    };
    if (head_dim == 64) run(std::integral_constant<int, 64>{});
    else run(std::integral_constant<int, 128>{});
  });
  return out;
}
