// Python bindings of the kernels in this folder (one module, built by pagedllm.kernels).
#include "ops.h"

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
