// The kernels' entry points, for the Python bindings and for C++ callers (decode_layers.cpp).
#pragma once
#include <torch/extension.h>
#include <vector>

// The level this build's target flags give (pagedllm.kernels.build): what its #ifs chose.
inline const char* built_isa() {
#if defined(__AVX512BF16__) && defined(__AVX512VNNI__)
  return "avx512";
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
  return "avx2";
#else
  return "portable";
#endif
}

// Caches in the query's dtype, or int8 with float32 scales (paged_cache.h). softcap,
// window: AttentionOptions (paged_cache.h), 0 for none.
torch::Tensor paged_decode_attention(torch::Tensor query, torch::Tensor key_cache,
                                     torch::Tensor value_cache, torch::Tensor block_tables,
                                     torch::Tensor seq_lens, double scale,
                                     c10::optional<torch::Tensor> key_scales,
                                     c10::optional<torch::Tensor> value_scales,
                                     double softcap = 0.0, int64_t window = 0);
torch::Tensor paged_prefill_attention(torch::Tensor query, torch::Tensor key_cache,
                                      torch::Tensor value_cache, torch::Tensor block_table,
                                      int64_t start, double scale,
                                      c10::optional<torch::Tensor> key_scales,
                                      c10::optional<torch::Tensor> value_scales,
                                      double softcap = 0.0, int64_t window = 0);
torch::Tensor rms_norm(torch::Tensor x, c10::optional<torch::Tensor> residual,
                       torch::Tensor weight, double eps);
torch::Tensor rope_write_kv(torch::Tensor qkv, torch::Tensor positions, torch::Tensor cos,
                            torch::Tensor sin, torch::Tensor key_cache, torch::Tensor value_cache,
                            torch::Tensor slot_mapping, int64_t num_heads,
                            c10::optional<torch::Tensor> key_scales,
                            c10::optional<torch::Tensor> value_scales);
torch::Tensor silu_and_mul(torch::Tensor x);
torch::Tensor q4_pack(torch::Tensor codes, torch::Tensor d, torch::Tensor m);
torch::Tensor q4k_pack(torch::Tensor codes, torch::Tensor scales, torch::Tensor mins,
                       torch::Tensor d, torch::Tensor dmin);
torch::Tensor q4_gemm(torch::Tensor x, torch::Tensor packed);
torch::Tensor q6_pack(torch::Tensor codes, torch::Tensor scales, torch::Tensor d);
torch::Tensor q6_gemm(torch::Tensor x, torch::Tensor packed);
torch::Tensor q4_q8_gemm(torch::Tensor x, torch::Tensor packed);
torch::Tensor q4_linear(torch::Tensor x, torch::Tensor packed, int64_t exact_max_rows);
std::vector<torch::Tensor> decode_layers(torch::Tensor hidden, torch::Tensor positions,
                                         torch::Tensor cos, torch::Tensor sin,
                                         std::vector<std::vector<torch::Tensor>> weights,
                                         std::vector<torch::Tensor> key_caches,
                                         std::vector<torch::Tensor> value_caches,
                                         std::vector<torch::Tensor> key_scales,
                                         std::vector<torch::Tensor> value_scales,
                                         torch::Tensor slot_mapping, torch::Tensor block_tables,
                                         torch::Tensor seq_lens, int64_t num_heads, double eps,
                                         double scale, std::vector<int64_t> exact_max_rows);
// The last size of a packed Q6_K / Q8_0 weight (q6_pack's, q8_pack's block): what tells a
// packed part's kernel in decode_layers.
constexpr int64_t kQ6PackedBlockBytes = 3360, kQ8PackedBlockBytes = 544;
torch::Tensor q8_pack(torch::Tensor codes, torch::Tensor d);
torch::Tensor q8_gemm(torch::Tensor x, torch::Tensor packed);
torch::Tensor q8_refine_top(torch::Tensor logits, torch::Tensor hidden, torch::Tensor codes,
                            torch::Tensor d, int64_t top);

// Used by paged_prefill_attention: the tiled bfloat16 prefill kernel (prefill_attention.cpp),
// given checked arguments. Its output where it applies (bfloat16, built with AVX512-BF16),
// nothing otherwise (head sizes not a multiple of 32 included).
struct PagedCache;
struct AttentionOptions;
c10::optional<torch::Tensor> tiled_prefill_attention(const torch::Tensor& query,
                                                     const PagedCache& cache,
                                                     const torch::Tensor& block_table,
                                                     int64_t start, const AttentionOptions& options);
