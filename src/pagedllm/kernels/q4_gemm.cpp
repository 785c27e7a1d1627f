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
// - q4_i16_gemm, for the same few rows where bfloat16 pair dot products are slow (Intel's
//   cores: kernels/cpu.py chooses): the activations held as 16-bit integers per group, exact
//   within 6 binades of the group's largest value, on two int8 integer dot products each.
// - q4_q8_gemm, for the many rows of a prefill, where the products are the cost: the
//   activations rounded to int8 first, then integer dot products (AVX512-VNNI, or AVX2's
//   vpmaddubsw as llama.cpp's Q4 x Q8) at twice the products per instruction.
// q4_linear picks between them by row count. The weights are repacked once into tiles of 16
// output rows (q4_layout.h): per group four 64-byte vectors of codes, lane i holding 8 codes
// of output row i, and the scales as the GGUF file stores them: d and m as float16 per group
// (q4_pack: Q4_0, Q4_1), or Q4_K's 6-bit scales and mins per group under a float16 d and dmin
// per 256 inputs (q4k_pack).
// Every CPU level builds all four (q4_i16_gemm is the exact product below avx512); the tiles
// (the inner products) come from the header of the level this file is compiled for: AVX-512
// BF16/VNNI, AVX2 (vpmaddubsw), or portable C++.
#include <type_traits>

#if defined(__x86_64__) && defined(__linux__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "kernels.h"
#include "q4_layout.h"
#if defined(__AVX512BF16__) && defined(__AVX512VNNI__)
#include "q4_tiles_avx512.h"
#include "q4_tiles_amx.h"
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

#if defined(PAGEDLLM_INT16_TILES)
template <class L>
struct Int16Tiles {
  using Fn = decltype(&tile_rows_int16<L, 1>);
  static constexpr Fn kFns[kRowBlock + 1] = {
      nullptr, tile_rows_int16<L, 1>, tile_rows_int16<L, 2>, tile_rows_int16<L, 3>, tile_rows_int16<L, 4>,
      tile_rows_int16<L, 5>, tile_rows_int16<L, 6>, tile_rows_int16<L, 7>, tile_rows_int16<L, 8>};
};
#endif

// The 16 lanes of code vector j of row block `rows` (16 rows of [N, K] codes from input k0):
// lane i holds the codes of inputs k0 + 8j .. k0 + 8j + 7 of row i, at code_shift's bits.
void pack_codes(const uint8_t* rows, int64_t k, int64_t k0, uint8_t* vectors) {
  for (int64_t i = 0; i < kTile; ++i)
    for (int j = 0; j < 4; ++j) {
      uint32_t lane = 0;
      for (int c8 = 0; c8 < 8; ++c8) {
        lane |= static_cast<uint32_t>(rows[i * k + k0 + 8 * j + c8]) << code_shift(c8);
      }
      std::memcpy(vectors + 64 * j + 4 * i, &lane, 4);
    }
}

}  // namespace

namespace pagedllm::kernel {

static_assert(GroupLayout::kBlockBytes == kQ4PackedBlockBytes && SuperLayout::kBlockBytes == kQ4KPackedBlockBytes,
              "kernels.h names the 4-bit blocks' sizes");

void q4_pack(const uint8_t* src, const f16* d, const f16* m, int64_t n, int64_t k, uint8_t* dst) {
  constexpr int64_t kBlockBytes = GroupLayout::kBlockBytes;
  const int64_t groups = k / kGroup;
  for (int64_t t = 0; t < n / kTile; ++t) {
    for (int64_t g = 0; g < groups; ++g) {
      uint8_t* block = dst + (t * groups + g) * kBlockBytes;
      pack_codes(src + t * kTile * k, k, g * kGroup, block);
      for (int64_t i = 0; i < kTile; ++i) {
        const int64_t row = t * kTile + i;
        std::memcpy(block + kCodeBytes + 2 * i, d + row * groups + g, 2);
        std::memcpy(block + kCodeBytes + 32 + 2 * i, m + row * groups + g, 2);
      }
    }
  }
}

void q4k_pack(const uint8_t* src, const uint8_t* scp, const uint8_t* mnp, const f16* dp,
              const f16* dminp, int64_t n, int64_t k, uint8_t* dst) {
  constexpr int64_t kPer = SuperLayout::kGroupsPerBlock, kBlockBytes = SuperLayout::kBlockBytes;
  const int64_t groups = k / kGroup, blocks = groups / kPer;
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
}

namespace {

// x [rows, k] @ the packed weight -> out [rows, n] bfloat16, exactly (the tile's sums are
// float32 over bfloat16 products, which are exact).
void exact_gemm(const bf16* x, const uint8_t* wp, bool super, bool amx, int64_t rows, int64_t k,
                int64_t n, bf16* op) {
  const int64_t groups = k / kGroup, tiles = n / kTile;
  const int64_t tile_bytes = super ? groups / SuperLayout::kGroupsPerBlock * SuperLayout::kBlockBytes
                                   : groups * GroupLayout::kBlockBytes;
  // The activations in the type this level's exact tile reads (bfloat16, or float32).
  std::unique_ptr<ExactInput[]> widened;
  const ExactInput* xp;
  if constexpr (std::is_same_v<ExactInput, bf16>) {
    xp = reinterpret_cast<const ExactInput*>(x);  // the same type: no copy
  } else {
    widened = pagedllm::scratch<ExactInput>(rows * k);
    for (int64_t i = 0; i < rows * k; ++i) widened[i] = ExactInput(static_cast<float>(x[i]));
    xp = widened.get();
  }
  // sum(x) per row and group, over the bfloat16 values the dot products see.
  const auto xsum = pagedllm::scratch<float>(rows * groups);
  float* xs = xsum.get();
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t g = 0; g < groups; ++g) {
      float s = 0.0f;
      for (int64_t i = 0; i < kGroup; ++i) s += static_cast<float>(xp[r * k + g * kGroup + i]);
      xs[r * groups + g] = s;
    }
#if defined(PAGEDLLM_AMX_TILES)
  if (amx) {
    if (super) amx_exact_gemm<SuperLayout>(wp, tile_bytes, tiles, xp, k, rows, xs, op, n);
    else amx_exact_gemm<GroupLayout>(wp, tile_bytes, tiles, xp, k, rows, xs, op, n);
    return;
  }
#endif
  const auto* fns = super ? Tiles<SuperLayout>::kExact : Tiles<GroupLayout>::kExact;
  for_each_tile(tiles, rows, [&](int64_t t, int64_t r0, int rb) {
    fns[rb](wp + t * tile_bytes, groups, xp + r0 * k, k, xs + r0 * groups, op + r0 * n + t * kTile, n);
  });
}

// The same with x held as 16-bit integers per group of 32 (split_rows), where this level has
// the int16 tile (avx512: VNNI); the exact product elsewhere.
void int16_gemm(const bf16* x, const uint8_t* wp, bool super, int64_t rows, int64_t k, int64_t n,
                bf16* op) {
#if defined(PAGEDLLM_INT16_TILES)
  const int64_t groups = k / kGroup, tiles = n / kTile;
  const int64_t tile_bytes = super ? groups / SuperLayout::kGroupsPerBlock * SuperLayout::kBlockBytes
                                   : groups * GroupLayout::kBlockBytes;
  const Int16Rows xq = split_rows(x, rows, k);
  const auto* fns = super ? Int16Tiles<SuperLayout>::kFns : Int16Tiles<GroupLayout>::kFns;
  for_each_tile(tiles, rows, [&](int64_t t, int64_t r0, int rb) {
    fns[rb](wp + t * tile_bytes, groups, xq.high.get() + r0 * k, xq.low.get() + r0 * k, k,
            xq.scale.get() + r0 * groups, xq.sum.get() + r0 * groups, op + r0 * n + t * kTile, n);
  });
#else
  exact_gemm(x, wp, super, false, rows, k, n, op);
#endif
}

// The same with x rounded to int8 first (as llama.cpp multiplies 4-bit weights: one scale per
// group of 32 for Q4_0/Q4_1, per 256 inputs for Q4_K, as its Q8_0 and Q8_K): approximate, and
// about twice the arithmetic rate, for the many rows of a prefill.
void int8_gemm(const bf16* x, const uint8_t* wp, bool super, int64_t rows, int64_t k, int64_t n,
               bf16* op) {
  const int64_t groups = k / kGroup, tiles = n / kTile;
  const int64_t tile_bytes = super ? groups / SuperLayout::kGroupsPerBlock * SuperLayout::kBlockBytes
                                   : groups * GroupLayout::kBlockBytes;
  const Int8Rows xq = quantize_rows<kInterleavedCodes>(x, rows, k, super ? SuperLayout::kGroupsPerBlock : 1);
  const auto dx_sum = pagedllm::scratch<float>(rows * groups);
  for (int64_t i = 0; i < rows * groups; ++i)  // dx * sum(xq), for the m term
    dx_sum[i] = xq.scale[i] * static_cast<float>(xq.sum[i]);
  // Q4_K's code sums by pairs of groups, as the int16 halves of one int32 (each is at most
  // 32 x 127): the tiles that fold its mins in integers read them.
  std::unique_ptr<int32_t[]> pairs;
  if (super) {
    pairs = pagedllm::scratch<int32_t>(rows * groups / 2);
    for (int64_t i = 0; i < rows * groups / 2; ++i)
      pairs[i] = static_cast<int32_t>(static_cast<uint16_t>(xq.sum[2 * i]) |
                                      static_cast<uint32_t>(static_cast<uint16_t>(xq.sum[2 * i + 1])) << 16);
  }
  const int8_t* qp = xq.codes.get();
  const float* dp = xq.scale.get();
  const float* sp = dx_sum.get();
  const int32_t* pp = pairs.get();
  const auto* fns = super ? Tiles<SuperLayout>::kInt8 : Tiles<GroupLayout>::kInt8;
  for_each_tile(tiles, rows, [&](int64_t t, int64_t r0, int rb) {
    fns[rb](wp + t * tile_bytes, groups, qp + r0 * k, k, dp + r0 * groups, sp + r0 * groups,
            pp ? pp + r0 * groups / 2 : nullptr, op + r0 * n + t * kTile, n);
  });
}

}  // namespace

bool amx_tiles_usable() {
#if defined(PAGEDLLM_AMX_TILES) && defined(__linux__)
  // The CPU's AMX-TILE and AMX-BF16 (CPUID leaf 7: EDX bits 24 and 22), read once.
  static const bool in_cpu = [] {
    unsigned a, b, c, d;
    return __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d >> 24 & 1u) && (d >> 22 & 1u);
  }();
  // Linux's permission for the tiles' state (ARCH_GET_XCOMP_PERM, bit 18: XTILEDATA), which
  // kernels/cpu.py asks for; remembered once held (it is never taken back).
  static std::atomic<bool> granted{false};
  if (!in_cpu) return false;
  if (!granted.load(std::memory_order_relaxed)) {
    unsigned long features = 0;
    if (syscall(SYS_arch_prctl, 0x1022, &features) == 0 && (features >> 18 & 1ul)) granted = true;
  }
  return granted.load(std::memory_order_relaxed);
#else
  return false;
#endif
}

void q4_bf16_gemm(const bf16* x, const uint8_t* packed, bool super, int64_t rows, int64_t k, int64_t n,
                  bf16* out) {
  if (rows == 0) return;
#if defined(PAGEDLLM_AMX_TILES)
  if (amx_tiles_usable()) {
    const int64_t groups = k / kGroup, tiles = n / kTile;
    const int64_t tile_bytes = super ? groups / SuperLayout::kGroupsPerBlock * SuperLayout::kBlockBytes
                                     : groups * GroupLayout::kBlockBytes;
    if (super) amx_q4_bf16_gemm<SuperLayout>(packed, tile_bytes, tiles, x, k, rows, out, n);
    else amx_q4_bf16_gemm<GroupLayout>(packed, tile_bytes, tiles, x, k, rows, out, n);
    return;
  }
#endif
  exact_gemm(x, packed, super, false, rows, k, n, out);
}

void q4_gemm(const bf16* x, const uint8_t* packed, bool super, Q4Product product, int64_t rows,
             int64_t k, int64_t n, bf16* out) {
  if (rows == 0) return;
  switch (product) {
    case Q4Product::kExact: return exact_gemm(x, packed, super, false, rows, k, n, out);
    case Q4Product::kAmx: return exact_gemm(x, packed, super, amx_tiles_usable(), rows, k, n, out);
    case Q4Product::kInt16: return int16_gemm(x, packed, super, rows, k, n, out);
    case Q4Product::kInt8: return int8_gemm(x, packed, super, rows, k, n, out);
  }
}

bool int16_tiles_built() {
#if defined(PAGEDLLM_INT16_TILES)
  return true;
#else
  return false;
#endif
}

}  // namespace pagedllm::kernel
