// Python bindings of the kernels in this folder (one module, built by pagedllm.kernels): the
// only translation unit that includes torch's headers. The torch ops it binds (tensor_ops.h,
// decode_layers.h) check their tensors and call the kernels on raw pointers (kernels.h).
#include <algorithm>

#include "decode_layers.h"
#include "tensor_ops.h"

// The kernels' thread count (plain.h): torch's, as torch.set_num_threads sets it.
int pagedllm::num_threads() { return at::get_num_threads(); }

using namespace pagedllm::ops;

// Every kernel runs with the GIL released, as torch's own ops do: none touches a Python
// object, and the server's HTTP thread (health checks, metrics, streaming) is not held up
// by a long kernel. Throughput did not change measurably (paired A/B of `pagedllm bench` at
// N=8, four runs each: wall time ratio 1.01).
using NoGil = pybind11::call_guard<pybind11::gil_scoped_release>;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using pybind11::arg;
  m.def("paged_decode_attention", &paged_decode_attention, NoGil(), "paged decode attention (CPU)",
        arg("query"), arg("key_cache"), arg("value_cache"), arg("block_tables"), arg("seq_lens"),
        arg("scale"), arg("key_scales") = pybind11::none(), arg("value_scales") = pybind11::none(),
        arg("softcap") = 0.0, arg("window") = 0);
  m.def("paged_prefill_attention", &paged_prefill_attention, NoGil(),
        "causal attention of one sequence's prefill chunk over the paged cache (CPU)",
        arg("query"), arg("key_cache"), arg("value_cache"), arg("block_table"), arg("start"),
        arg("scale"), arg("key_scales") = pybind11::none(), arg("value_scales") = pybind11::none(),
        arg("softcap") = 0.0, arg("window") = 0);
  m.def("rms_norm", &rms_norm, NoGil(), "RMSNorm, optionally adding x into residual first (in place)",
        arg("x"), arg("residual"), arg("weight"), arg("eps"));
  m.def("rope_write_kv", &rope_write_kv, NoGil(), "RoPE on q and k; k and v written to the paged cache",
        arg("qkv"), arg("positions"), arg("cos"), arg("sin"), arg("key_cache"), arg("value_cache"),
        arg("slot_mapping"), arg("num_heads"), arg("key_scales") = pybind11::none(),
        arg("value_scales") = pybind11::none());
  m.def("silu_and_mul", &silu_and_mul, NoGil(), "silu(gate) * up");
  m.def("lowbit_dequantize", &lowbit_dequantize, NoGil(),
        "a packed 4-bit or Q8_0 weight -> its transpose, dense [K, N] bfloat16 (into out when given)");
  m.def("lora_add", &lora_add, NoGil(),
        "y += scale * B[slot] @ (A[slot] @ x) per token with a slot (LoRA, in place)");
  m.def("isa", &pagedllm::kernel::built_isa, "the CPU level this module was built for: portable, avx2 or avx512");
  m.def("q4_pack", &q4_pack, NoGil(), "4-bit codes, d, m -> the tiles q4_gemm reads");
  m.def("q4k_pack", &q4k_pack, NoGil(),
        "Q4_K's codes, 6-bit scales and mins, d, dmin -> the tiles q4_gemm reads (super-blocks)");
  m.def("q4_gemm", &q4_gemm, NoGil(), "x [M, K] bfloat16 @ packed 4-bit weight.T -> [M, N] bfloat16",
        arg("x"), arg("packed"), arg("amx") = false);
  m.def("q4_bf16_gemm", &q4_bf16_gemm, NoGil(),
        "x [M, K] bfloat16 @ packed 4-bit weight.T rounded to bfloat16 -> [M, N] (AMX tiles; exact elsewhere)");
  m.def("amx_tiles_usable", &pagedllm::kernel::amx_tiles_usable,
        "whether q4_gemm's amx runs on the AMX tiles: this build has them (avx512 level), the CPU "
        "too, and Linux granted this process their state");
  m.def("q4_q8_gemm", &q4_q8_gemm, NoGil(),
        "x [M, K] bfloat16, rounded to int8 per group of 32, @ packed 4-bit weight.T -> [M, N] bfloat16");
  m.def("q4_i16_gemm", &q4_i16_gemm, NoGil(),
        "x [M, K] bfloat16, held as 16-bit integers per group of 32, @ packed 4-bit weight.T -> "
        "[M, N] bfloat16 (the avx2 and avx512 levels; exact, q4_gemm, on the portable one)");
  m.def("int16_tiles_built", &pagedllm::kernel::int16_tiles_built,
        "whether q4_i16_gemm has its own tile in this build (avx2, avx512), rather than q4_gemm's");
  m.def("q4_linear", &q4_linear, NoGil(),
        "q4_gemm up to exact_max_rows rows (q4_i16_gemm up to int16_max_rows, on the AMX tiles "
        "from amx_min_rows), q4_q8_gemm above",
        arg("x"), arg("packed"), arg("exact_max_rows"), arg("amx_min_rows") = kNoRows,
        arg("int16_max_rows") = 0);
  m.def("decode_layers", &decode_layers, NoGil(),
        "every decoder layer of a decode step (q4_gemm projections, C++ attention) in one call");
  m.def("q6_pack", &q6_pack, NoGil(), "Q6_K's codes, int8 scales per 16, d -> the tiles q6_gemm reads");
  m.def("q6_gemm", &q6_gemm, NoGil(),
        "x [M, K] bfloat16, rounded to int8 per group of 32, @ packed Q6_K weight.T -> [M, N] float32");
  m.def("q6_bf16_gemm", &q6_bf16_gemm, NoGil(),
        "x [M, K] bfloat16 @ packed Q6_K weight.T rounded to bfloat16 -> [M, N] bfloat16 (AMX tiles)");
  m.def("q8_pack", &q8_pack, NoGil(), "Q8_0 codes, d -> the tiles q8_gemm reads");
  m.def("q8_gemm", &q8_gemm, NoGil(), "x [M, K] bfloat16 @ packed 8-bit weight.T -> [M, N] float32");
  m.def("roof_int8", &pagedllm::kernel::roof_int8, NoGil(),
        "int8 multiply-adds done in `iterations` register-only steps on every kernel thread "
        "(this level's instruction mix: vpmaddubsw + vpaddw at avx2, vpdpbusd at avx512)");
  m.def("roof_fma", &pagedllm::kernel::roof_fma, NoGil(),
        "float32 FMAs done in `iterations` register-only steps on every kernel thread");
  m.def("roof_read", [](torch::Tensor buffer) {
          TORCH_CHECK(buffer.scalar_type() == at::kByte && buffer.is_contiguous(), "a contiguous uint8 buffer");
          return pagedllm::kernel::roof_read(buffer.data_ptr<uint8_t>(), buffer.numel());
        }, NoGil(), "reads the whole buffer on every kernel thread (its XOR, so nothing is skipped)");
  m.def("q8_refine_top", &q8_refine_top, NoGil(),
        "each row's top logits recomputed exactly from the Q8_0 codes (in place)");
}
