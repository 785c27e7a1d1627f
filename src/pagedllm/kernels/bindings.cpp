// Python bindings of the kernels in this folder (one module, built by pagedllm.kernels).
#include <torch/extension.h>

torch::Tensor paged_decode_attention(torch::Tensor query, torch::Tensor key_cache,
                                     torch::Tensor value_cache, torch::Tensor block_tables,
                                     torch::Tensor seq_lens, double scale);
torch::Tensor paged_prefill_attention(torch::Tensor query, torch::Tensor key_cache,
                                      torch::Tensor value_cache, torch::Tensor block_table,
                                      int64_t start, double scale);
torch::Tensor rms_norm(torch::Tensor x, c10::optional<torch::Tensor> residual,
                       torch::Tensor weight, double eps);
torch::Tensor rope_write_kv(torch::Tensor qkv, torch::Tensor positions, torch::Tensor cos,
                            torch::Tensor sin, torch::Tensor key_cache, torch::Tensor value_cache,
                            torch::Tensor slot_mapping, int64_t num_heads);
torch::Tensor silu_and_mul(torch::Tensor x);
bool q4_gemm_available();
torch::Tensor q4_pack(torch::Tensor codes, torch::Tensor d, torch::Tensor m);
torch::Tensor q4_gemm(torch::Tensor x, torch::Tensor packed);
bool q8_gemm_available();
std::vector<torch::Tensor> decode_layers(torch::Tensor hidden, torch::Tensor positions,
                                         torch::Tensor cos, torch::Tensor sin,
                                         std::vector<torch::Tensor> weights,
                                         std::vector<torch::Tensor> key_caches,
                                         std::vector<torch::Tensor> value_caches,
                                         torch::Tensor slot_mapping, torch::Tensor block_tables,
                                         torch::Tensor seq_lens, int64_t num_heads, double eps,
                                         double scale);
torch::Tensor q8_pack(torch::Tensor codes, torch::Tensor d);
torch::Tensor q8_gemm(torch::Tensor x, torch::Tensor packed);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "paged decode attention (CPU)");
  m.def("paged_prefill_attention", &paged_prefill_attention,
        "causal attention of one sequence's prefill chunk over the paged cache (CPU)");
  m.def("rms_norm", &rms_norm, "RMSNorm, optionally adding x into residual first (in place)",
        pybind11::arg("x"), pybind11::arg("residual"), pybind11::arg("weight"), pybind11::arg("eps"));
  m.def("rope_write_kv", &rope_write_kv, "RoPE on q and k; k and v written to the paged cache");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up");
  m.def("q4_gemm_available", &q4_gemm_available, "whether q4_gemm was built (AVX512-BF16)");
  m.def("q4_pack", &q4_pack, "4-bit codes, d, m -> the tiles q4_gemm reads");
  m.def("q4_gemm", &q4_gemm, "x [M, K] bfloat16 @ packed 4-bit weight.T -> [M, N] bfloat16");
  m.def("decode_layers", &decode_layers,
        "every decoder layer of a decode step (q4_gemm projections, C++ attention) in one call");
  m.def("q8_gemm_available", &q8_gemm_available, "whether q8_gemm was built (AVX512-VNNI)");
  m.def("q8_pack", &q8_pack, "Q8_0 codes, d -> the tiles q8_gemm reads");
  m.def("q8_gemm", &q8_gemm, "x [M, K] bfloat16 @ packed 8-bit weight.T -> [M, N] float32");
}
