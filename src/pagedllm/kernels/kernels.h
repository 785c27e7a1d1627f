// The kernels' entry points on raw pointers and sizes: what the kernel translation units
// (paged_attention.cpp, prefill_attention.cpp, fused_ops.cpp, q4/q6/q8_gemm.cpp) define and
// the binding unit (bindings.cpp, the only one with torch) calls once it has checked the
// tensors. Nothing here checks shapes: the callers have.
#pragma once
#include <cstdint>
#include <vector>

#include "paged_cache.h"
#include "plain.h"

namespace pagedllm::kernel {

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

// The last size of a packed Q4_0/Q4_1, Q4_K, Q6_K and Q8_0 weight (their pack's block): what
// tells a packed weight's kernel.
constexpr int64_t kQ4PackedBlockBytes = 320, kQ4KPackedBlockBytes = 2368,
                  kQ6PackedBlockBytes = 3360, kQ8PackedBlockBytes = 544;
// Weights are packed in tiles of 16 output rows and groups of 32 inputs.
constexpr int64_t kTileRows = 16, kGroupInputs = 32;

// paged_attention.cpp. query, out [num_seqs, num_heads, head_dim]; tables: num_seqs rows of
// max_blocks block ids (max_blocks 0: every row the same table); seq_lens [num_seqs].
void paged_attention(DType dtype, const void* query, const PagedCache& cache,
                     const int64_t* tables, int64_t max_blocks, const int64_t* seq_lens,
                     void* out, int64_t num_seqs, int64_t num_heads, const AttentionOptions& options);

// prefill_attention.cpp: the tiled bfloat16 prefill kernel. query, out [tokens, heads,
// head_dim] at positions start.. over table. False (out untouched) where it does not apply:
// not bfloat16, a head size not a multiple of 32, or a build without AVX512-BF16.
bool tiled_prefill_attention(DType dtype, const void* query, int64_t tokens, int64_t heads,
                             const PagedCache& cache, const int64_t* table, int64_t start,
                             const AttentionOptions& options, void* out);

// fused_ops.cpp. x, out [rows, hidden]; residual (or null) [rows, hidden], updated in place.
void rms_norm(DType dtype, const void* x, void* residual, const void* weight, void* out,
              int64_t rows, int64_t hidden, float eps);
// qkv [tokens, (heads + 2 kv_heads) head_dim] -> q_out [tokens, heads, head_dim]; K, V into
// the caches' slots (int8 with scales where the cache is quantized).
void rope_write_kv(DType dtype, const void* qkv, const int64_t* positions, const float* cos,
                   const float* sin, const PagedCache& cache, const int64_t* slots, void* q_out,
                   int64_t tokens, int64_t heads);
void silu_and_mul(DType dtype, const void* x, void* out, int64_t rows, int64_t width);

// q4_dequant.cpp. A packed 4-bit weight (q4_pack / q4k_pack: super) -> dense bfloat16, its
// transpose [k, n].
void q4_dequantize(const uint8_t* packed, bool super, int64_t n, int64_t k, bf16* out);
// The same for a packed Q8_0 weight (q8_pack).
void q8_dequantize(const uint8_t* packed, int64_t n, int64_t k, bf16* out);

// lora_sgmv.cpp. For each token with slots[t] >= 0 and each part p of a fused projection:
// y[t, cols of p] += scales[t] * (a[slot, p*rank:(p+1)*rank] @ x[t]) @ b[slot, :, cols of p];
// x [tokens, fan_in], a [slots, parts * rank, fan_in], b [slots, rank, fan_out], all of
// dtype; part_starts: the parts' first columns, then fan_out.
void lora_add(DType dtype, void* y, const void* x, const void* a, const void* b,
              const int64_t* slots, const float* scales, const std::vector<int64_t>& part_starts,
              int64_t tokens, int64_t fan_in, int64_t fan_out, int64_t rank);

// q4_gemm.cpp. codes [n, k] (0..15); d16, m16 [n, k / 32] float16 -> packed [n / 16, k / 32, 320].
void q4_pack(const uint8_t* codes, const f16* d, const f16* m, int64_t n, int64_t k, uint8_t* packed);
// Q4_K: scales, mins [n, k / 32] (0..63); d, neg_dmin [n, k / 256] float16 -> [n / 16, k / 256, 2368].
void q4k_pack(const uint8_t* codes, const uint8_t* scales, const uint8_t* mins, const f16* d,
              const f16* neg_dmin, int64_t n, int64_t k, uint8_t* packed);
// How q4_gemm multiplies. kExact: the exact tile (bfloat16 activations, exact products).
// kAmx: the same product on the AMX tiles (q4_tiles_amx.h) where amx_tiles_usable(), else
// kExact. kInt16: the activations as 16-bit integers per group of 32 (lowbit_gemm.h:
// split_rows) on integer dot products, where int16_tiles_built(), else kExact. kInt8: the
// activations rounded to int8 first, a scale per group of 32 (per 256 inputs for Q4_K)
// (q4_q8_gemm).
enum class Q4Product { kExact, kAmx, kInt16, kInt8 };
// x [rows, k] @ the packed [n, k].T -> out [rows, n]; super: packed by q4k_pack.
void q4_gemm(const bf16* x, const uint8_t* packed, bool super, Q4Product product, int64_t rows,
             int64_t k, int64_t n, bf16* out);
// This build has the 16-bit activation tile (the avx512 level: AVX512-VNNI).
bool int16_tiles_built();
// The same product with each weight rounded to bfloat16 first (as dequantizing it for a dense
// product does), fused on the AMX tiles where amx_tiles_usable(); exactly (q4_gemm) elsewhere.
void q4_bf16_gemm(const bf16* x, const uint8_t* packed, bool super, int64_t rows, int64_t k, int64_t n,
                  bf16* out);
// This build has the AMX tile kernels (the avx512 level on x86-64 Linux), the CPU has the
// tiles, and Linux has granted this process their state (kernels/cpu.py asks).
bool amx_tiles_usable();

// q6_gemm.cpp. codes [n, k] (0..63); scales [n, k / 16]; d [n, k / 256] float16.
void q6_pack(const uint8_t* codes, const int8_t* scales, const f16* d, int64_t n, int64_t k,
             uint8_t* packed);
void q6_gemm(const bf16* x, const uint8_t* packed, int64_t rows, int64_t k, int64_t n, float* out);
// x @ the Q6_K weight rounded to bfloat16 per element, on the AMX tiles where
// amx_tiles_usable() (else q6_gemm's int8-activation product), bfloat16 out.
void q6_bf16_gemm(const bf16* x, const uint8_t* packed, int64_t rows, int64_t k, int64_t n, bf16* out);

// q8_gemm.cpp. codes [n, k]; d [n, k / 32] float16.
void q8_pack(const int8_t* codes, const f16* d, int64_t n, int64_t k, uint8_t* packed);
void q8_gemm(const bf16* x, const uint8_t* packed, int64_t rows, int64_t k, int64_t n, float* out);
// logits [rows, n] (in place); hidden [rows, k] float32; codes [n, k]; d [n, k / 32] float32.
void q8_refine_top(float* logits, const float* hidden, const int8_t* codes, const float* d,
                   int64_t rows, int64_t n, int64_t k, int64_t top);

// roof.cpp: this host's peaks on every kernel thread (benchmarks/roof.py). roof_int8 and
// roof_fma return the multiply-adds done in `iterations` steps; roof_read the XOR of the
// buffer's words (so that its reads cannot be dropped).
double roof_int8(int64_t iterations);
double roof_fma(int64_t iterations);
int64_t roof_read(const uint8_t* data, int64_t bytes);

}  // namespace pagedllm::kernel
