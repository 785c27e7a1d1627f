// The kernels as torch ops: each checks its tensors (dtype, shape, contiguity, ranges),
// allocates the output and calls the kernel on raw pointers (kernels.h). Included by
// bindings.cpp alone, so that torch's headers are parsed once per build (plain.h says why).
#pragma once
#include <torch/extension.h>

#include <vector>

#include "dtype.h"
#include "kernels.h"

namespace pagedllm::ops {

namespace kernel = pagedllm::kernel;
using kernel::kGroupInputs;
using kernel::kTileRows;
// A row count no step reaches: "never" for the row thresholds below.
constexpr int64_t kNoRows = std::numeric_limits<int64_t>::max();

inline DType dtype_of(const torch::Tensor& t) {
  return t.scalar_type() == at::kBFloat16 ? DType::BFloat16 : DType::Float32;
}

template <typename T>
const T* as(const torch::Tensor& t) {
  return reinterpret_cast<const T*>(t.data_ptr());
}

template <typename T>
T* as_mut(torch::Tensor& t) {
  return reinterpret_cast<T*>(t.data_ptr());
}

// ---- attention -------------------------------------------------------------------------

// Checks a layer's key and value caches for activations of `dtype` (the query's, or qkv's
// when writing): contiguous, 4-D and alike, in that dtype or int8 with float32 scales
// [num_blocks, block_size, kv_heads] for both; returns them as the kernels read them.
inline PagedCache cache_of(const torch::Tensor& key_cache, const torch::Tensor& value_cache,
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
  PagedCache cache;
  if (quantized) {
    for (const auto* t : {&*key_scales, &*value_scales})
      TORCH_CHECK(t->scalar_type() == torch::kFloat && t->is_contiguous() &&
                  t->sizes() == key_cache.sizes().slice(0, 3),
                  "scales must be contiguous float32 [num_blocks, block_size, kv_heads]");
    cache.key_scales = key_scales->data_ptr<float>();
    cache.value_scales = value_scales->data_ptr<float>();
  }
  cache.key = key_cache.data_ptr();
  cache.value = value_cache.data_ptr();
  cache.block_size = key_cache.size(1);
  cache.kv_heads = key_cache.size(2);
  cache.head_dim = key_cache.size(3);
  cache.quantized = quantized;
  return cache;
}

// The caches checked against the query [tokens, heads, head_dim] that reads them.
inline PagedCache query_cache(const torch::Tensor& query, const torch::Tensor& key_cache,
                              const torch::Tensor& value_cache,
                              const c10::optional<torch::Tensor>& key_scales,
                              const c10::optional<torch::Tensor>& value_scales) {
  TORCH_CHECK(query.dim() == 3, "query must be [tokens, heads, head_dim]");
  TORCH_CHECK(query.scalar_type() == torch::kFloat || query.scalar_type() == torch::kBFloat16,
              "query must be float32 or bfloat16");
  const PagedCache cache = cache_of(key_cache, value_cache, key_scales, value_scales, query.scalar_type());
  TORCH_CHECK(query.size(2) == key_cache.size(3), "query and cache head_dim differ");
  TORCH_CHECK(query.size(1) % cache.kv_heads == 0, "heads must be a multiple of KV heads");
  TORCH_CHECK(pagedllm::supported_head_dim(query.size(2)), "head_dim must be 64, 80, 96, 128 or 256");
  return cache;
}

inline AttentionOptions options(double scale, double softcap, int64_t window) {
  TORCH_CHECK(softcap >= 0.0 && window >= 0, "softcap and window must be >= 0 (0: none)");
  return {static_cast<float>(scale), static_cast<float>(softcap), window};
}

// query [S, H, D]; caches [num_blocks, block_size, KVH, D] in the query's dtype, or int8 with
// float32 scales [num_blocks, block_size, KVH]; block_tables [S, max_blocks] int64; seq_lens
// [S] int64. Returns [S, H, D] in the query dtype.
inline torch::Tensor paged_decode_attention(torch::Tensor query, torch::Tensor key_cache,
                                            torch::Tensor value_cache, torch::Tensor block_tables,
                                            torch::Tensor seq_lens, double scale,
                                            c10::optional<torch::Tensor> key_scales,
                                            c10::optional<torch::Tensor> value_scales,
                                            double softcap = 0.0, int64_t window = 0) {
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt64 && seq_lens.scalar_type() == torch::kInt64,
              "block_tables and seq_lens must be int64");
  block_tables = block_tables.contiguous();
  seq_lens = seq_lens.contiguous();
  query = query.contiguous();
  const PagedCache cache = query_cache(query, key_cache, value_cache, key_scales, value_scales);
  auto out = torch::empty_like(query);
  kernel::paged_attention(dtype_of(query), query.data_ptr(), cache, block_tables.data_ptr<int64_t>(),
                          block_tables.size(1), seq_lens.data_ptr<int64_t>(), out.data_ptr(),
                          query.size(0), query.size(1), options(scale, softcap, window));
  return out;
}

// Prefill chunk of one sequence: query [T, H, D] holds the tokens at positions start..start+T-1,
// whose K/V are already in the cache; each attends causally to positions <= its own. bfloat16
// chunks take the tiled kernel (prefill_attention.cpp) in the avx512 and avx2 builds; otherwise each
// token is a one-query "sequence" over the same table, with its own length.
inline torch::Tensor paged_prefill_attention(torch::Tensor query, torch::Tensor key_cache,
                                             torch::Tensor value_cache, torch::Tensor block_table,
                                             int64_t start, double scale,
                                             c10::optional<torch::Tensor> key_scales,
                                             c10::optional<torch::Tensor> value_scales,
                                             double softcap = 0.0, int64_t window = 0) {
  TORCH_CHECK(block_table.scalar_type() == torch::kInt64 && block_table.dim() == 1,
              "block_table must be 1-D int64");
  TORCH_CHECK(query.dim() == 3 && key_cache.dim() == 4, "bad shapes");
  block_table = block_table.contiguous();
  const int64_t tokens = query.size(0);
  TORCH_CHECK(start >= 0 && start + tokens <= block_table.size(0) * key_cache.size(1),
              "the chunk runs past its block table");
  query = query.contiguous();
  const PagedCache cache = query_cache(query, key_cache, value_cache, key_scales, value_scales);
  const AttentionOptions opts = options(scale, softcap, window);
  auto out = torch::empty_like(query);
  const int64_t* table = block_table.data_ptr<int64_t>();
  if (kernel::tiled_prefill_attention(dtype_of(query), query.data_ptr(), tokens, query.size(1),
                                      cache, table, start, opts, out.data_ptr()))
    return out;
  auto lens = torch::arange(start + 1, start + tokens + 1, block_table.options());
  kernel::paged_attention(dtype_of(query), query.data_ptr(), cache, table, /*max_blocks=*/0,
                          lens.data_ptr<int64_t>(), out.data_ptr(), tokens, query.size(1), opts);
  return out;
}

// ---- fused element-wise ops ------------------------------------------------------------

inline void check_rows(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.is_contiguous(), name, " must be a contiguous 2-D tensor");
  TORCH_CHECK(t.scalar_type() == torch::kFloat || t.scalar_type() == torch::kBFloat16,
              name, " must be float32 or bfloat16");
}

// out = rms_norm(x) * weight. With residual: residual += x first (in place) and the sum is
// normalised, the pre-norm residual pattern of Llama layers. x, residual [T, H]; weight [H].
inline torch::Tensor rms_norm(torch::Tensor x, c10::optional<torch::Tensor> residual,
                              torch::Tensor weight, double eps) {
  check_rows(x, "x");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1) &&
              weight.scalar_type() == x.scalar_type(), "weight must be [H] in x's dtype");
  if (residual) {
    check_rows(*residual, "residual");
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->scalar_type() == x.scalar_type(),
                "residual must match x");
  }
  auto out = torch::empty_like(x);
  kernel::rms_norm(dtype_of(x), x.data_ptr(), residual ? residual->data_ptr() : nullptr,
                   weight.data_ptr(), out.data_ptr(), x.size(0), x.size(1), static_cast<float>(eps));
  return out;
}

// qkv [T, (H + 2 KVH) D] -> q [T, H, D] with RoPE applied; K (rotated) and V are written to
// their slots of the paged caches [blocks, block_size, KVH, D]: in qkv's dtype, or int8 with
// their scales [blocks, block_size, KVH] float32. cos/sin [positions, D] f32.
inline torch::Tensor rope_write_kv(torch::Tensor qkv, torch::Tensor positions, torch::Tensor cos,
                                   torch::Tensor sin, torch::Tensor key_cache,
                                   torch::Tensor value_cache, torch::Tensor slot_mapping,
                                   int64_t num_heads, c10::optional<torch::Tensor> key_scales,
                                   c10::optional<torch::Tensor> value_scales) {
  check_rows(qkv, "qkv");
  const PagedCache cache = cache_of(key_cache, value_cache, key_scales, value_scales, qkv.scalar_type());
  TORCH_CHECK(cos.scalar_type() == torch::kFloat && sin.scalar_type() == torch::kFloat &&
              cos.is_contiguous() && sin.is_contiguous(), "cos/sin must be contiguous float32");
  TORCH_CHECK(positions.scalar_type() == torch::kInt64 && slot_mapping.scalar_type() == torch::kInt64,
              "positions and slot_mapping must be int64");
  positions = positions.contiguous();
  slot_mapping = slot_mapping.contiguous();
  const int64_t tokens = qkv.size(0), kv_heads = cache.kv_heads, head_dim = cache.head_dim;
  TORCH_CHECK(qkv.size(1) == (num_heads + 2 * kv_heads) * head_dim && head_dim % 2 == 0 &&
              cos.size(1) == head_dim, "qkv width does not match the heads");
  TORCH_CHECK(positions.numel() == tokens && slot_mapping.numel() == tokens, "one position and slot per token");
  const int64_t num_slots = key_cache.size(0) * key_cache.size(1);
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(pos[t] >= 0 && pos[t] < cos.size(0), "position out of the RoPE table");
    TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "slot out of the cache");
  }
  auto q = torch::empty({tokens, num_heads, head_dim}, qkv.options());
  kernel::rope_write_kv(dtype_of(qkv), qkv.data_ptr(), pos, cos.data_ptr<float>(), sin.data_ptr<float>(),
                        cache, slots, q.data_ptr(), tokens, num_heads);
  return q;
}

// x [T, 2I] (gate then up) -> silu(gate) * up [T, I].
inline torch::Tensor silu_and_mul(torch::Tensor x) {
  check_rows(x, "x");
  TORCH_CHECK(x.size(1) % 2 == 0, "x must hold gate and up halves");
  auto out = torch::empty({x.size(0), x.size(1) / 2}, x.options());
  kernel::silu_and_mul(dtype_of(x), x.data_ptr(), out.data_ptr(), x.size(0), x.size(1) / 2);
  return out;
}

// LoRA: y [T, out] += each token's adapter products, part by part, in place (lora_sgmv.cpp).
inline void lora_add(torch::Tensor y, torch::Tensor x, torch::Tensor a, torch::Tensor b,
                     torch::Tensor slots, torch::Tensor scales, std::vector<int64_t> part_starts) {
  check_rows(x, "x");
  check_rows(y, "y");
  TORCH_CHECK(a.dim() == 3 && b.dim() == 3 && a.is_contiguous() && b.is_contiguous(),
              "a and b must be contiguous [slots, parts * rank, in] and [slots, rank, out]");
  TORCH_CHECK(x.scalar_type() == y.scalar_type() && a.scalar_type() == x.scalar_type() &&
              b.scalar_type() == x.scalar_type(), "x, y, a and b must share one dtype");
  const int64_t tokens = x.size(0), rank = b.size(1);
  const int64_t parts = static_cast<int64_t>(part_starts.size()) - 1;
  TORCH_CHECK(parts >= 1 && part_starts.front() == 0 && part_starts.back() == y.size(1) &&
              std::is_sorted(part_starts.begin(), part_starts.end()),
              "part_starts must run from 0 to out");
  TORCH_CHECK(y.size(0) == tokens && a.size(2) == x.size(1) && b.size(2) == y.size(1) &&
              a.size(1) == parts * rank && b.size(0) == a.size(0),
              "x, y, a and b shapes disagree");
  TORCH_CHECK(slots.dim() == 1 && slots.numel() == tokens && slots.scalar_type() == torch::kLong &&
              slots.is_contiguous(), "slots must be [tokens] int64");
  TORCH_CHECK(scales.dim() == 1 && scales.numel() == tokens && scales.scalar_type() == torch::kFloat &&
              scales.is_contiguous(), "scales must be [tokens] float32");
  const int64_t* s = slots.data_ptr<int64_t>();
  TORCH_CHECK(std::all_of(s, s + tokens, [&](int64_t v) { return v < a.size(0); }),
              "a slot is past the stacks' ", a.size(0));
  kernel::lora_add(dtype_of(x), y.data_ptr(), x.data_ptr(), a.data_ptr(), b.data_ptr(), s,
                   scales.data_ptr<float>(), part_starts, tokens, x.size(1), y.size(1), rank);
}

// ---- low-bit weights -------------------------------------------------------------------

// Checks a weight to pack: codes [N, K] of the given dtype, N a whole number of tiles, K of
// groups, every code below `limit` (unsigned codes). Returns the number of groups.
inline int64_t check_pack(const torch::Tensor& codes, at::ScalarType dtype, const char* dtype_name,
                          int limit = 0, const char* range = "") {
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == dtype, "codes must be [N, K] ", dtype_name);
  TORCH_CHECK(codes.size(0) % kTileRows == 0, "output rows must be a multiple of ", kTileRows, ", got ", codes.size(0));
  TORCH_CHECK(codes.size(1) % kGroupInputs == 0, "inputs must be a multiple of ", kGroupInputs, ", got ", codes.size(1));
  if (limit > 0 && codes.numel() > 0)
    TORCH_CHECK(codes.max().item<int>() < limit, "codes must be in ", range);
  return codes.size(1) / kGroupInputs;
}

// float32 scales (exact float16 values) as the float16 the packed tiles hold.
inline torch::Tensor halves(const torch::Tensor& t) { return t.to(at::kHalf).contiguous(); }

// codes [N, K] uint8 (0..15), d and m [N, K / 32] float32 (exact float16 values) ->
// the packed tiles, [N / 16, K / 32, 320] uint8.
inline torch::Tensor q4_pack(torch::Tensor codes, torch::Tensor d, torch::Tensor m) {
  const int64_t groups = check_pack(codes, at::kByte, "uint8", 16, "0..15");
  const int64_t n = codes.size(0), k = codes.size(1);
  for (const auto& t : {d, m})
    TORCH_CHECK(t.dim() == 2 && t.size(0) == n && t.size(1) == groups, "d and m must be [N, K / 32]");
  auto c = codes.contiguous(), d16 = halves(d), m16 = halves(m);
  auto packed = torch::zeros({n / kTileRows, groups, kernel::kQ4PackedBlockBytes}, codes.options());
  kernel::q4_pack(c.data_ptr<uint8_t>(), as<f16>(d16), as<f16>(m16), n, k, packed.data_ptr<uint8_t>());
  return packed;
}

// Q4_K as the file holds it: codes [N, K] uint8 (0..15), scales and mins [N, K / 32] uint8
// (0..63), d and dmin [N, K / 256] float32 (exact float16 values), w = d * sc * q - dmin * mn
// -> the packed tiles, [N / 16, K / 256, 2368] uint8.
inline torch::Tensor q4k_pack(torch::Tensor codes, torch::Tensor scales, torch::Tensor mins,
                              torch::Tensor d, torch::Tensor dmin) {
  const int64_t groups = check_pack(codes, at::kByte, "uint8", 16, "0..15");
  constexpr int64_t kPer = 8;  // groups of 32 per block of 256
  const int64_t n = codes.size(0), k = codes.size(1), blocks = groups / kPer;
  TORCH_CHECK(groups % kPer == 0, "inputs must be a multiple of ", kPer * kGroupInputs, ", got ", k);
  for (const auto& t : {scales, mins})
    TORCH_CHECK(t.dim() == 2 && t.size(0) == n && t.size(1) == groups && t.scalar_type() == at::kByte,
                "scales and mins must be [N, K / 32] uint8");
  for (const auto& t : {d, dmin})
    TORCH_CHECK(t.dim() == 2 && t.size(0) == n && t.size(1) == blocks, "d and dmin must be [N, K / 256]");
  auto c = codes.contiguous(), sc = scales.contiguous(), mn = mins.contiguous();
  TORCH_CHECK(sc.max().item<int>() < 64 && mn.max().item<int>() < 64, "scales and mins must be in 0..63");
  auto d16 = halves(d), neg_dmin16 = halves(dmin.neg());
  auto packed = torch::zeros({n / kTileRows, blocks, kernel::kQ4KPackedBlockBytes}, codes.options());
  kernel::q4k_pack(c.data_ptr<uint8_t>(), sc.data_ptr<uint8_t>(), mn.data_ptr<uint8_t>(), as<f16>(d16),
                   as<f16>(neg_dmin16), n, k, packed.data_ptr<uint8_t>());
  return packed;
}

// Checks x [M, K] bfloat16 against a packed weight [N / 16, K / (32 * groups_per_block),
// block_bytes]; returns x contiguous.
inline torch::Tensor check_gemm(const torch::Tensor& x, const torch::Tensor& packed, int64_t block_bytes,
                                const char* pack_fn, int64_t groups_per_block = 1) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "x must be [M, K] bfloat16");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kByte && packed.size(2) == block_bytes,
              "packed must come from ", pack_fn);
  TORCH_CHECK(packed.is_contiguous(), "packed must be contiguous");
  const int64_t groups = packed.size(1) * groups_per_block;
  TORCH_CHECK(x.size(1) == groups * kGroupInputs, "x has ", x.size(1), " inputs, the weight ",
              groups * kGroupInputs);
  return x.contiguous();
}

// A 4-bit product, as kernels.h's Q4Product says.
inline torch::Tensor q4_product(const torch::Tensor& x, const torch::Tensor& packed,
                                kernel::Q4Product product) {
  const bool super = packed.dim() == 3 && packed.size(2) == kernel::kQ4KPackedBlockBytes;
  const auto xc = super ? check_gemm(x, packed, kernel::kQ4KPackedBlockBytes, "q4k_pack", 8)
                        : check_gemm(x, packed, kernel::kQ4PackedBlockBytes, "q4_pack");
  const int64_t rows = xc.size(0), n = packed.size(0) * kTileRows;
  auto out = torch::empty({rows, n}, x.options());
  kernel::q4_gemm(as<bf16>(xc), packed.data_ptr<uint8_t>(), super, product, rows, xc.size(1), n,
                  as_mut<bf16>(out));
  return out;
}

// A packed 4-bit (q4_pack, q4k_pack) or Q8_0 (q8_pack) weight's transpose as a dense [K, N]
// bfloat16 matrix (into `out` when given: a buffer reused from call to call).
inline torch::Tensor lowbit_dequantize(torch::Tensor packed, int64_t k, c10::optional<torch::Tensor> out) {
  TORCH_CHECK(packed.dim() == 3 && packed.is_contiguous() && packed.scalar_type() == at::kByte,
              "packed must be a 4-bit or Q8_0 weight from q4_pack, q4k_pack or q8_pack");
  const int64_t block = packed.size(2);
  const bool super = block == kernel::kQ4KPackedBlockBytes, q8 = block == kernel::kQ8PackedBlockBytes;
  TORCH_CHECK(super || q8 || block == kernel::kQ4PackedBlockBytes,
              "packed must be a 4-bit or Q8_0 weight from q4_pack, q4k_pack or q8_pack");
  const int64_t per_block = super ? 256 : kGroupInputs;
  TORCH_CHECK(k > 0 && k == packed.size(1) * per_block, "k must be the packed weight's inputs, ",
              packed.size(1) * per_block);
  const int64_t n = packed.size(0) * kTileRows;
  auto dense = out ? *out : torch::empty({k, n}, packed.options().dtype(at::kBFloat16));
  TORCH_CHECK(dense.dim() == 2 && dense.size(0) == k && dense.size(1) == n && dense.is_contiguous() &&
              dense.scalar_type() == at::kBFloat16, "out must be [", k, ", ", n, "] bfloat16");
  if (q8) kernel::q8_dequantize(packed.data_ptr<uint8_t>(), n, k, as_mut<bf16>(dense));
  else kernel::q4_dequantize(packed.data_ptr<uint8_t>(), super, n, k, as_mut<bf16>(dense));
  return dense;
}

// x [M, K] bfloat16 @ the packed weight's [N, K].T -> [M, N] bfloat16, exactly.
// x @ the 4-bit weight rounded to bfloat16 per element: the many-row steps' product on the
// AMX tiles (kernels.h: q4_bf16_gemm).
inline torch::Tensor q4_bf16_gemm(torch::Tensor x, torch::Tensor packed) {
  const bool super = packed.dim() == 3 && packed.size(2) == kernel::kQ4KPackedBlockBytes;
  const auto xc = super ? check_gemm(x, packed, kernel::kQ4KPackedBlockBytes, "q4k_pack", 8)
                        : check_gemm(x, packed, kernel::kQ4PackedBlockBytes, "q4_pack");
  const int64_t rows = xc.size(0), n = packed.size(0) * kTileRows;
  auto out = torch::empty({rows, n}, x.options());
  kernel::q4_bf16_gemm(as<bf16>(xc), packed.data_ptr<uint8_t>(), super, rows, xc.size(1), n,
                       as_mut<bf16>(out));
  return out;
}

inline torch::Tensor q4_gemm(torch::Tensor x, torch::Tensor packed, bool amx) {
  return q4_product(x, packed, amx ? kernel::Q4Product::kAmx : kernel::Q4Product::kExact);
}

// The few-row product with x held as 16-bit integers per group of 32 (kernels.h: kInt16).
inline torch::Tensor q4_i16_gemm(torch::Tensor x, torch::Tensor packed) {
  return q4_product(x, packed, kernel::Q4Product::kInt16);
}

// The same with x rounded to int8 first (a scale per group of 32, per 256 inputs for Q4_K), as
// llama.cpp multiplies 4-bit weights: approximate, and about twice the arithmetic rate, for
// the many rows of a prefill.
inline torch::Tensor q4_q8_gemm(torch::Tensor x, torch::Tensor packed) {
  return q4_product(x, packed, kernel::Q4Product::kInt8);
}

// The 4-bit product a layer takes at this row count: exact (q4_gemm) up to exact_max_rows,
// for decode steps of a few sequences, where it costs the same; activations rounded to int8
// (q4_q8_gemm) above, where that is 1.3-1.5x faster (benchmarks/linear_kernels.py). Within
// the exact range, up to int16_max_rows rows take 16-bit integer activations (q4_i16_gemm),
// and from amx_min_rows rows the AMX tiles.
inline torch::Tensor q4_linear(torch::Tensor x, torch::Tensor packed, int64_t exact_max_rows,
                               int64_t amx_min_rows, int64_t int16_max_rows) {
  using kernel::Q4Product;
  const int64_t rows = x.size(0);
  const Q4Product product = rows > exact_max_rows  ? Q4Product::kInt8
                            : rows <= int16_max_rows ? Q4Product::kInt16
                            : rows >= amx_min_rows   ? Q4Product::kAmx
                                                     : Q4Product::kExact;
  return q4_product(x, packed, product);
}

// codes [N, K] uint8 (0..63), scales [N, K / 16] int8, d [N, K / 256] float32 (exact float16
// values), w = d * sc * (q - 32) -> the packed tiles, [N / 16, K / 256, 3360] uint8.
inline torch::Tensor q6_pack(torch::Tensor codes, torch::Tensor scales, torch::Tensor d) {
  const int64_t groups = check_pack(codes, at::kByte, "uint8", 64, "0..63");
  constexpr int64_t kPer = 8;
  const int64_t n = codes.size(0), k = codes.size(1), blocks = groups / kPer;
  TORCH_CHECK(groups % kPer == 0, "inputs must be a multiple of ", kPer * kGroupInputs, ", got ", k);
  TORCH_CHECK(scales.dim() == 2 && scales.size(0) == n && scales.size(1) == 2 * groups &&
              scales.scalar_type() == at::kChar, "scales must be [N, K / 16] int8");
  TORCH_CHECK(d.dim() == 2 && d.size(0) == n && d.size(1) == blocks, "d must be [N, K / 256]");
  auto c = codes.contiguous(), sc = scales.contiguous(), d16 = halves(d);
  auto packed = torch::zeros({n / kTileRows, blocks, kernel::kQ6PackedBlockBytes}, codes.options());
  kernel::q6_pack(c.data_ptr<uint8_t>(), sc.data_ptr<int8_t>(), as<f16>(d16), n, k, packed.data_ptr<uint8_t>());
  return packed;
}

// x [M, K] bfloat16 @ the packed weight's [N, K].T -> [M, N] float32.
inline torch::Tensor q6_gemm(torch::Tensor x, torch::Tensor packed) {
  const auto xc = check_gemm(x, packed, kernel::kQ6PackedBlockBytes, "q6_pack", 8);
  const int64_t rows = xc.size(0), n = packed.size(0) * kTileRows;
  auto out = torch::empty({rows, n}, x.options().dtype(at::kFloat));
  kernel::q6_gemm(as<bf16>(xc), packed.data_ptr<uint8_t>(), rows, xc.size(1), n, out.data_ptr<float>());
  return out;
}

// x [M, K] bfloat16 @ the packed Q6_K weight rounded to bfloat16 -> [M, N] bfloat16: the
// many-row steps' product on the AMX tiles (kernels.h: q6_bf16_gemm).
inline torch::Tensor q6_bf16_gemm(torch::Tensor x, torch::Tensor packed) {
  const auto xc = check_gemm(x, packed, kernel::kQ6PackedBlockBytes, "q6_pack", 8);
  const int64_t rows = xc.size(0), n = packed.size(0) * kTileRows;
  auto out = torch::empty({rows, n}, x.options().dtype(at::kBFloat16));
  kernel::q6_bf16_gemm(as<bf16>(xc), packed.data_ptr<uint8_t>(), rows, xc.size(1), n, as_mut<bf16>(out));
  return out;
}

// codes [N, K] int8, d [N, K / 32] float32 (exact float16 values) -> the packed tiles,
// [N / 16, K / 32, 544] uint8.
inline torch::Tensor q8_pack(torch::Tensor codes, torch::Tensor d) {
  const int64_t groups = check_pack(codes, at::kChar, "int8");
  const int64_t n = codes.size(0), k = codes.size(1);
  TORCH_CHECK(d.dim() == 2 && d.size(0) == n && d.size(1) == groups, "d must be [N, K / 32]");
  auto c = codes.contiguous(), d16 = halves(d);
  auto packed = torch::empty({n / kTileRows, groups, kernel::kQ8PackedBlockBytes}, codes.options().dtype(at::kByte));
  kernel::q8_pack(c.data_ptr<int8_t>(), as<f16>(d16), n, k, packed.data_ptr<uint8_t>());
  return packed;
}

// x [M, K] bfloat16 @ the packed weight's [N, K].T -> [M, N] float32.
inline torch::Tensor q8_gemm(torch::Tensor x, torch::Tensor packed) {
  const auto xc = check_gemm(x, packed, kernel::kQ8PackedBlockBytes, "q8_pack");
  const int64_t rows = xc.size(0), n = packed.size(0) * kTileRows;
  auto out = torch::empty({rows, n}, x.options().dtype(at::kFloat));
  kernel::q8_gemm(as<bf16>(xc), packed.data_ptr<uint8_t>(), rows, xc.size(1), n, out.data_ptr<float>());
  return out;
}

// logits [M, N] float32 (q8_gemm's, in place), hidden [M, K] bfloat16, codes [N, K] int8,
// d [N, K / 32] float32: each row's `top` largest logits recomputed exactly.
inline torch::Tensor q8_refine_top(torch::Tensor logits, torch::Tensor hidden, torch::Tensor codes,
                                   torch::Tensor d, int64_t top) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous(),
              "logits must be contiguous [M, N] float32");
  TORCH_CHECK(hidden.dim() == 2 && hidden.size(0) == logits.size(0), "hidden must be [M, K]");
  const int64_t groups = check_pack(codes, at::kChar, "int8");
  const int64_t rows = logits.size(0), n = logits.size(1), k = hidden.size(1);
  TORCH_CHECK(codes.size(0) == n && codes.size(1) == k, "codes must be [N, K] for logits [M, N]");
  TORCH_CHECK(d.dim() == 2 && d.size(0) == n && d.size(1) == groups && d.scalar_type() == at::kFloat,
              "d must be [N, K / 32] float32");
  TORCH_CHECK(top >= 1 && top <= n, "top must be in 1..N");
  auto h = hidden.to(at::kFloat).contiguous(), c = codes.contiguous(), dc = d.contiguous();
  kernel::q8_refine_top(logits.data_ptr<float>(), h.data_ptr<float>(), c.data_ptr<int8_t>(),
                        dc.data_ptr<float>(), rows, n, k, top);
  return logits;
}

}  // namespace pagedllm::ops
