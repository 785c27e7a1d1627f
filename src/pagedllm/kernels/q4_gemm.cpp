// x @ W.T for 4-bit GGUF weights (Q4_0 / Q4_1 / Q4_K: w = d * q + m, q in 0..15, one (d, m)
// per 32 inputs), two ways over the same packed tiles:
// - q4_gemm, exact, for the few rows of a decode step. torch's int4 kernel turns each weight
//   into float32 and multiplies with float32 FMAs, which makes it compute-bound from ~4 rows
//   (benchmarks/linear_kernels.py); this one multiplies without rounding anything (on
//   AVX512-BF16, with its pair dot product; elsewhere with float32 FMAs):
//   - 128 + q is exact in bfloat16 (bits 0x4300 | q), so a code becomes a bfloat16 with one
//     and + or, and x . (128 + q) over a group is one dot-product chain in float32;
//   - per group, sum x*w = d * (x . (128 + q)) + (m - 128 d) * sum(x), so the scales are
//     applied once per 32 inputs, with sum(x) computed once per call.
// - q4_q8_gemm, for the many rows of a prefill, where the products are the cost: the
//   activations rounded to int8 first, then integer dot products (AVX512-VNNI, or AVX2's
//   vpmaddubsw as llama.cpp's Q4 x Q8) at twice the products per instruction.
// q4_linear picks between them by row count. The weights are repacked once into tiles of 16
// output rows (q4_layout.h): per group four 64-byte vectors of codes, lane i holding 8 codes
// of output row i, and the scales as the GGUF file stores them: d and m as float16 per group
// (q4_pack: Q4_0, Q4_1), or Q4_K's 6-bit scales and mins per group under a float16 d and dmin
// per 256 inputs (q4k_pack).
// Every CPU level builds all three; the tiles (the inner products) come from the header of
// the level this file is compiled for: AVX-512 BF16/VNNI, AVX2 (vpmaddubsw), or portable C++.
#include "ops.h"
#include "q4_layout.h"
#if defined(__AVX512BF16__) && defined(__AVX512VNNI__)
#include "q4_tiles_avx512.h"
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include "q4_tiles_avx2.h"
#else
#include "q4_tiles_portable.h"
#endif

using namespace pagedllm::q4;

namespace {

// Each level's header defines tile_rows<L, R> and tile_rows_int8<L, R> for R = 1..kRowBlock.
template <class L>
struct Tiles {
  using TileFn = decltype(&tile_rows<L, 1>);
  static constexpr TileFn kExact[kRowBlock + 1] = {
      nullptr, tile_rows<L, 1>, tile_rows<L, 2>, tile_rows<L, 3>, tile_rows<L, 4>,
      tile_rows<L, 5>, tile_rows<L, 6>, tile_rows<L, 7>, tile_rows<L, 8>};
  using Int8TileFn = decltype(&tile_rows_int8<L, 1>);
  static constexpr Int8TileFn kInt8[kRowBlock + 1] = {
      nullptr, tile_rows_int8<L, 1>, tile_rows_int8<L, 2>, tile_rows_int8<L, 3>, tile_rows_int8<L, 4>,
      tile_rows_int8<L, 5>, tile_rows_int8<L, 6>, tile_rows_int8<L, 7>, tile_rows_int8<L, 8>};
};

// The 16 lanes of code vector j of row block `rows` (16 rows of [N, K] codes from input k0):
// lane i holds the codes of inputs k0 + 8j .. k0 + 8j + 7 of row i, at code_shift's bits.
void pack_codes(const uint8_t* rows, int64_t k, int64_t k0, uint8_t* vectors) {
  for (int64_t i = 0; i < kTile; ++i)
    for (int j = 0; j < 4; ++j) {
      uint32_t lane = 0;
      for (int c8 = 0; c8 < 8; ++c8) {
        const uint32_t q = rows[i * k + k0 + 8 * j + c8];
        TORCH_CHECK(q < 16, "codes must be in 0..15");
        lane |= q << code_shift(c8);
      }
      std::memcpy(vectors + 64 * j + 4 * i, &lane, 4);
    }
}

// A packed weight's shape and whether its block size names SuperLayout.
struct Packed {
  GemmShape shape;
  bool super;
};

Packed check_packed(const torch::Tensor& x, const torch::Tensor& packed) {
  const bool super = packed.dim() == 3 && packed.size(2) == SuperLayout::kBlockBytes;
  if (super)
    return {check_gemm(x, packed, SuperLayout::kBlockBytes, "q4k_pack", SuperLayout::kGroupsPerBlock), true};
  return {check_gemm(x, packed, GroupLayout::kBlockBytes, "q4_pack"), false};
}

}  // namespace


// codes [N, K] uint8 (0..15), d and m [N, K / 32] float32 (exact float16 values) ->
// the packed tiles (GroupLayout), [N / 16, K / 32, 320] uint8.
torch::Tensor q4_pack(torch::Tensor codes, torch::Tensor d, torch::Tensor m) {
  const int64_t groups = check_pack(codes, at::kByte, "uint8");
  const int64_t n = codes.size(0), k = codes.size(1);
  for (const auto& t : {d, m})
    TORCH_CHECK(t.dim() == 2 && t.size(0) == n && t.size(1) == groups, "d and m must be [N, K / 32]");
  auto c = codes.contiguous();
  auto d16 = d.to(at::kHalf).contiguous(), m16 = m.to(at::kHalf).contiguous();
  constexpr int64_t kBlockBytes = GroupLayout::kBlockBytes;
  auto packed = torch::zeros({n / kTile, groups, kBlockBytes}, codes.options());
  const uint8_t* src = c.data_ptr<uint8_t>();
  uint8_t* dst = packed.data_ptr<uint8_t>();
  const auto* dsrc = d16.data_ptr<at::Half>();
  const auto* msrc = m16.data_ptr<at::Half>();
  for (int64_t t = 0; t < n / kTile; ++t) {
    for (int64_t g = 0; g < groups; ++g) {
      uint8_t* block = dst + (t * groups + g) * kBlockBytes;
      pack_codes(src + t * kTile * k, k, g * kGroup, block);
      for (int64_t i = 0; i < kTile; ++i) {
        const int64_t row = t * kTile + i;
        std::memcpy(block + kCodeBytes + 2 * i, dsrc + row * groups + g, 2);
        std::memcpy(block + kCodeBytes + 32 + 2 * i, msrc + row * groups + g, 2);
      }
    }
  }
  return packed;
}

// Q4_K as the file holds it: codes [N, K] uint8 (0..15), scales and mins [N, K / 32] uint8
// (0..63), d and dmin [N, K / 256] float32 (exact float16 values), w = d * sc * q - dmin * mn
// -> the packed tiles (SuperLayout), [N / 16, K / 256, 2368] uint8.
torch::Tensor q4k_pack(torch::Tensor codes, torch::Tensor scales, torch::Tensor mins,
                       torch::Tensor d, torch::Tensor dmin) {
  const int64_t groups = check_pack(codes, at::kByte, "uint8");
  constexpr int64_t kPer = SuperLayout::kGroupsPerBlock;
  const int64_t n = codes.size(0), k = codes.size(1), blocks = groups / kPer;
  TORCH_CHECK(groups % kPer == 0, "inputs must be a multiple of ", kPer * kGroup, ", got ", k);
  for (const auto& t : {scales, mins})
    TORCH_CHECK(t.dim() == 2 && t.size(0) == n && t.size(1) == groups && t.scalar_type() == at::kByte,
                "scales and mins must be [N, K / 32] uint8");
  for (const auto& t : {d, dmin})
    TORCH_CHECK(t.dim() == 2 && t.size(0) == n && t.size(1) == blocks, "d and dmin must be [N, K / 256]");
  auto c = codes.contiguous(), sc = scales.contiguous(), mn = mins.contiguous();
  TORCH_CHECK(sc.max().item<int>() < 64 && mn.max().item<int>() < 64, "scales and mins must be in 0..63");
  auto d16 = d.to(at::kHalf).contiguous(), dmin16 = dmin.neg().to(at::kHalf).contiguous();
  constexpr int64_t kBlockBytes = SuperLayout::kBlockBytes;
  auto packed = torch::zeros({n / kTile, blocks, kBlockBytes}, codes.options());
  const uint8_t* src = c.data_ptr<uint8_t>();
  const uint8_t* scp = sc.data_ptr<uint8_t>();
  const uint8_t* mnp = mn.data_ptr<uint8_t>();
  const auto* dp = d16.data_ptr<at::Half>();
  const auto* dminp = dmin16.data_ptr<at::Half>();
  uint8_t* dst = packed.data_ptr<uint8_t>();
  for (int64_t t = 0; t < n / kTile; ++t)
    for (int64_t b = 0; b < blocks; ++b) {
      uint8_t* block = dst + (t * blocks + b) * kBlockBytes;
      for (int64_t j = 0; j < kPer; ++j) {
        const int64_t g = b * kPer + j;
        pack_codes(src + t * kTile * k, k, g * kGroup, block + j * kCodeBytes);
        for (int64_t i = 0; i < kTile; ++i) {
          block[SuperLayout::kScaleOffset + kTile * j + i] = scp[(t * kTile + i) * groups + g];
          block[SuperLayout::kMinOffset + kTile * j + i] = mnp[(t * kTile + i) * groups + g];
        }
      }
      for (int64_t i = 0; i < kTile; ++i) {
        const int64_t row = t * kTile + i;
        std::memcpy(block + SuperLayout::kDOffset + 2 * i, dp + row * blocks + b, 2);
        std::memcpy(block + SuperLayout::kDminOffset + 2 * i, dminp + row * blocks + b, 2);
      }
    }
  return packed;
}

// x [M, K] bfloat16 @ the packed weight's [N, K].T -> [M, N] bfloat16.
torch::Tensor q4_gemm(torch::Tensor x, torch::Tensor packed) {
  const Packed p = check_packed(x, packed);
  const int64_t rows = p.shape.rows, k = p.shape.k, tiles = p.shape.tiles, groups = p.shape.groups;
  // The activations in the type this level's exact tile reads (bfloat16, or float32).
  auto xc = x.to(c10::CppTypeToScalarType<ExactInput>::value).contiguous();
  auto out = torch::empty({rows, tiles * kTile}, x.options());
  if (rows == 0) return out;
  const auto* xp = xc.data_ptr<ExactInput>();
  // sum(x) per row and group, over the bfloat16 values the dot products see.
  auto xsum = torch::empty({rows, groups}, x.options().dtype(at::kFloat));
  float* xs = xsum.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t g = 0; g < groups; ++g) {
      float s = 0.0f;
      for (int64_t i = 0; i < kGroup; ++i) s += static_cast<float>(xp[r * k + g * kGroup + i]);
      xs[r * groups + g] = s;
    }
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  auto* op = out.data_ptr<at::BFloat16>();
  const int64_t n = tiles * kTile, tile_bytes = packed.size(1) * packed.size(2);
  const auto* fns = p.super ? Tiles<SuperLayout>::kExact : Tiles<GroupLayout>::kExact;
  for_each_tile(tiles, rows, [&](int64_t t, int64_t r0, int rb) {
    fns[rb](wp + t * tile_bytes, groups, xp + r0 * k, k, xs + r0 * groups, op + r0 * n + t * kTile, n);
  });
  return out;
}

// x [M, K] bfloat16 @ the packed weight's [N, K].T -> [M, N] bfloat16, with x rounded to
// int8 per group of 32 first (as llama.cpp multiplies Q4 weights): approximate, unlike
// q4_gemm, and about twice the arithmetic rate, for the many rows of a prefill.
torch::Tensor q4_q8_gemm(torch::Tensor x, torch::Tensor packed) {
  const Packed p = check_packed(x, packed);
  const int64_t rows = p.shape.rows, k = p.shape.k, tiles = p.shape.tiles, groups = p.shape.groups;
  auto out = torch::empty({rows, tiles * kTile}, x.options());
  if (rows == 0) return out;
  const Int8Rows xq = quantize_rows<kInterleavedCodes>(x);
  auto dx_sum = xq.scale * xq.sum;  // dx * sum(xq), for the m term
  const int8_t* qp = xq.codes.data_ptr<int8_t>();
  const float* dp = xq.scale.data_ptr<float>();
  const float* sp = dx_sum.data_ptr<float>();
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  auto* op = out.data_ptr<at::BFloat16>();
  const int64_t n = tiles * kTile, tile_bytes = packed.size(1) * packed.size(2);
  const auto* fns = p.super ? Tiles<SuperLayout>::kInt8 : Tiles<GroupLayout>::kInt8;
  for_each_tile(tiles, rows, [&](int64_t t, int64_t r0, int rb) {
    fns[rb](wp + t * tile_bytes, groups, qp + r0 * k, k, dp + r0 * groups, sp + r0 * groups,
            op + r0 * n + t * kTile, n);
  });
  return out;
}

// The 4-bit product a layer takes at this row count: exact (q4_gemm) up to exact_max_rows,
// for decode steps of a few sequences, where it costs the same; activations rounded to int8
// (q4_q8_gemm) above, where that is 1.3-1.5x faster (benchmarks/linear_kernels.py).
torch::Tensor q4_linear(torch::Tensor x, torch::Tensor packed, int64_t exact_max_rows) {
  if (x.size(0) <= exact_max_rows) return q4_gemm(x, packed);
  return q4_q8_gemm(x, packed);
}
