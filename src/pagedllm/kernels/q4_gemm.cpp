// x @ W.T for 4-bit GGUF weights (Q4_0 / Q4_1: w = d * q + m, q in 0..15, one (d, m) per 32
// inputs), two ways over the same packed tiles:
// - q4_gemm, exact, for the few rows of a decode step. torch's int4 kernel turns each weight
//   into float32 and multiplies with float32 FMAs, which makes it compute-bound from ~4 rows
//   (benchmarks/linear_kernels.py); this one feeds the codes to AVX512-BF16's pair dot
//   product without rounding anything:
//   - 128 + q is exact in bfloat16 (bits 0x4300 | q), so a code becomes a bfloat16 with one
//     and + or, and x . (128 + q) over a group is one dot-product chain in float32;
//   - per group, sum x*w = d * (x . (128 + q)) + (m - 128 d) * sum(x), so the scales are
//     applied once per 32 inputs, with sum(x) computed once per call.
// - q4_q8_gemm, for the many rows of a prefill, where the products are the cost: the
//   activations rounded to int8 first, then AVX512-VNNI at twice the products per
//   instruction (see tile_rows_int8).
// q4_linear picks between them by row count. The weights are repacked once (q4_pack) into
// tiles of 16 output rows: per tile and group, four 64-byte vectors of codes, lane i holding
// 8 codes of output row i, then the 16 d and the 16 m as float16, which are what the GGUF
// file stores.
#include "lowbit_gemm.h"
#include "ops.h"

using namespace pagedllm::lowbit;

namespace {

constexpr int64_t kCodeBytes = kTile * kGroup / 2;           // 256: 4 bits a code
constexpr int64_t kBlockBytes = kCodeBytes + 2 * kTile * 2;  // codes, then d and m (float16)

// Bit position, within lane i's 32 bits of code vector j, of the code of input 8j + c:
// a pair of inputs (2p, 2p + 1) sits at bits 4p and 16 + 4p, so (lane >> 4p) & 0x000F000F
// leaves exactly the pair as two 16-bit integers.
inline int code_shift(int c) { return (c % 2) * 16 + (c / 2) * 4; }

#if defined(__AVX512BF16__)

template <int P>
inline __m512bh codes_pair(__m512i v) {
  const __m512i q = _mm512_and_si512(_mm512_srli_epi32(v, 4 * P), _mm512_set1_epi32(0x000F000F));
  return (__m512bh)_mm512_or_si512(q, _mm512_set1_epi32(0x43004300));  // bfloat16 128 + q
}

template <int R, int S, int P>
inline void dot_pair(__m512 (&acc)[S][R], __m512i v, const at::BFloat16* x, int64_t ldx, int64_t k) {
  const __m512bh w = codes_pair<P>(v);
  for (int r = 0; r < R; ++r)
    acc[P % S][r] = _mm512_dpbf16_ps(acc[P % S][r], w, broadcast_pair(x + r * ldx + k + 2 * P));
}

// R rows of x times one tile of 16 output rows. The dot products run in R * S independent
// chains (S sets of accumulators taking turns): the instruction's latency needs about a dozen
// in flight to keep both of its pipes busy. The float32 totals live in memory, touched once
// per group, so that the registers go to the chains.
template <int R, int S>
void tile_rows(const uint8_t* tile, int64_t groups, const at::BFloat16* x, int64_t ldx,
               const float* xsum, at::BFloat16* out, int64_t ldo) {
  alignas(64) float total[R][kTile] = {};
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* block = tile + g * kBlockBytes;
    prefetch_ahead(block, kBlockBytes);
    __m512 acc[S][R];
    for (int s = 0; s < S; ++s)
      for (int r = 0; r < R; ++r) acc[s][r] = _mm512_setzero_ps();
    for (int j = 0; j < 4; ++j) {
      const __m512i v = _mm512_loadu_si512(block + 64 * j);
      const int64_t k = g * kGroup + 8 * j;
      dot_pair<R, S, 0>(acc, v, x, ldx, k);
      dot_pair<R, S, 1>(acc, v, x, ldx, k);
      dot_pair<R, S, 2>(acc, v, x, ldx, k);
      dot_pair<R, S, 3>(acc, v, x, ldx, k);
    }
    const __m512 d = load_halves(block + kCodeBytes);
    const __m512 m = load_halves(block + kCodeBytes + 32);
    const __m512 m_shifted = _mm512_fnmadd_ps(d, _mm512_set1_ps(128.0f), m);  // m - 128 d
    for (int r = 0; r < R; ++r) {
      __m512 sum = acc[0][r];
      for (int s = 1; s < S; ++s) sum = _mm512_add_ps(sum, acc[s][r]);
      __m512 t = _mm512_fmadd_ps(sum, d, _mm512_load_ps(total[r]));
      _mm512_store_ps(total[r], _mm512_fmadd_ps(m_shifted, _mm512_set1_ps(xsum[r * groups + g]), t));
    }
  }
  for (int r = 0; r < R; ++r)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * ldo),
                        (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(total[r])));
}

using TileFn = void (*)(const uint8_t*, int64_t, const at::BFloat16*, int64_t, const float*,
                        at::BFloat16*, int64_t);
constexpr TileFn kTileFns[kRowBlock + 1] = {
    nullptr, tile_rows<1, 2>, tile_rows<2, 2>, tile_rows<3, 2>, tile_rows<4, 2>,
    tile_rows<5, 2>, tile_rows<6, 2>, tile_rows<7, 2>, tile_rows<8, 2>};

#endif  // __AVX512BF16__

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)

// R rows of int8 activations (quantize_rows<true>) times one tile, for q4_q8_gemm. A code
// vector's lane holds 8 codes of one output row; masking the low and the high nibble of each
// byte gives two lanes of 4 codes as unsigned bytes, inputs (0 4 1 5) and (2 6 3 7), which
// the interleaved activation codes match. Per group:
//   sum x*w = dx * (d * (xq . q) + m * sum(xq)),
// the integer dot product exact in int32, the scales applied once per 32 inputs.
template <int R>
void tile_rows_int8(const uint8_t* tile, int64_t groups, const int8_t* xq, int64_t ldx,
                    const float* dx, const float* dx_sum, at::BFloat16* out, int64_t ldo) {
  __m512 total[R];
  for (int r = 0; r < R; ++r) total[r] = _mm512_setzero_ps();
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* block = tile + g * kBlockBytes;
    prefetch_ahead(block, kBlockBytes);
    __m512i acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_si512();
    for (int j = 0; j < 4; ++j) {
      const __m512i v = _mm512_loadu_si512(block + 64 * j);
      const __m512i low = _mm512_and_si512(v, nibble);
      const __m512i high = _mm512_and_si512(_mm512_srli_epi32(v, 4), nibble);
      const int8_t* x = xq + g * kGroup + 8 * j;
      for (int r = 0; r < R; ++r) {
        acc[r] = _mm512_dpbusd_epi32(acc[r], low, broadcast_quad(x + r * ldx));
        acc[r] = _mm512_dpbusd_epi32(acc[r], high, broadcast_quad(x + r * ldx + 4));
      }
    }
    const __m512 d = load_halves(block + kCodeBytes);
    const __m512 m = load_halves(block + kCodeBytes + 32);
    for (int r = 0; r < R; ++r) {
      const __m512 scale = _mm512_mul_ps(d, _mm512_set1_ps(dx[r * groups + g]));
      total[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r]), scale, total[r]);
      total[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(dx_sum[r * groups + g]), total[r]);
    }
  }
  for (int r = 0; r < R; ++r)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * ldo), (__m256i)_mm512_cvtneps_pbh(total[r]));
}

using Int8TileFn = void (*)(const uint8_t*, int64_t, const int8_t*, int64_t, const float*,
                            const float*, at::BFloat16*, int64_t);
constexpr Int8TileFn kInt8TileFns[kRowBlock + 1] = {
    nullptr, tile_rows_int8<1>, tile_rows_int8<2>, tile_rows_int8<3>, tile_rows_int8<4>,
    tile_rows_int8<5>, tile_rows_int8<6>, tile_rows_int8<7>, tile_rows_int8<8>};

#endif  // __AVX512VNNI__

}  // namespace

bool q4_gemm_available() { return available(); }

// codes [N, K] uint8 (0..15), d and m [N, K / 32] float32 (exact float16 values) ->
// the packed tiles, [N / 16, K / 32, kBlockBytes] uint8.
torch::Tensor q4_pack(torch::Tensor codes, torch::Tensor d, torch::Tensor m) {
  const int64_t groups = check_pack(codes, at::kByte, "uint8");
  const int64_t n = codes.size(0), k = codes.size(1);
  for (const auto& t : {d, m})
    TORCH_CHECK(t.dim() == 2 && t.size(0) == n && t.size(1) == groups, "d and m must be [N, K / 32]");
  auto c = codes.contiguous();
  auto d16 = d.to(at::kHalf).contiguous(), m16 = m.to(at::kHalf).contiguous();
  auto packed = torch::zeros({n / kTile, groups, kBlockBytes}, codes.options());
  const uint8_t* src = c.data_ptr<uint8_t>();
  uint8_t* dst = packed.data_ptr<uint8_t>();
  const auto* dsrc = d16.data_ptr<at::Half>();
  const auto* msrc = m16.data_ptr<at::Half>();
  for (int64_t t = 0; t < n / kTile; ++t) {
    for (int64_t g = 0; g < groups; ++g) {
      uint8_t* block = dst + (t * groups + g) * kBlockBytes;
      for (int64_t i = 0; i < kTile; ++i) {
        const int64_t row = t * kTile + i;
        for (int j = 0; j < 4; ++j) {
          uint32_t lane = 0;
          for (int c8 = 0; c8 < 8; ++c8) {
            const uint32_t q = src[row * k + g * kGroup + 8 * j + c8];
            TORCH_CHECK(q < 16, "codes must be in 0..15");
            lane |= q << code_shift(c8);
          }
          std::memcpy(block + 64 * j + 4 * i, &lane, 4);
        }
        std::memcpy(block + kCodeBytes + 2 * i, dsrc + row * groups + g, 2);
        std::memcpy(block + kCodeBytes + 32 + 2 * i, msrc + row * groups + g, 2);
      }
    }
  }
  return packed;
}

// x [M, K] bfloat16 @ the packed weight's [N, K].T -> [M, N] bfloat16.
torch::Tensor q4_gemm(torch::Tensor x, torch::Tensor packed) {
  TORCH_CHECK(q4_gemm_available(), "q4_gemm needs a CPU with AVX512-BF16 (and a build for it)");
  const GemmShape shape = check_gemm(x, packed, kBlockBytes, "q4_pack");
  const int64_t rows = shape.rows, k = shape.k, tiles = shape.tiles, groups = shape.groups;
  auto xc = x.contiguous();
  auto out = torch::empty({rows, tiles * kTile}, x.options());
  if (rows == 0) return out;
#if defined(__AVX512BF16__)
  const auto* xp = xc.data_ptr<at::BFloat16>();
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
  const int64_t n = tiles * kTile;
  for_each_tile(tiles, rows, [&](int64_t t, int64_t r0, int rb) {
    kTileFns[rb](wp + t * groups * kBlockBytes, groups, xp + r0 * k, k, xs + r0 * groups,
                 op + r0 * n + t * kTile, n);
  });
#endif
  return out;
}

bool q4_q8_gemm_available() {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

// x [M, K] bfloat16 @ the packed weight's [N, K].T -> [M, N] bfloat16, with x rounded to
// int8 per group of 32 first (as llama.cpp multiplies Q4 weights): approximate, unlike
// q4_gemm, and about twice the arithmetic rate, for the many rows of a prefill.
torch::Tensor q4_q8_gemm(torch::Tensor x, torch::Tensor packed) {
  TORCH_CHECK(q4_q8_gemm_available(), "q4_q8_gemm needs a CPU with AVX512-VNNI and AVX512-BF16");
  const GemmShape shape = check_gemm(x, packed, kBlockBytes, "q4_pack");
  const int64_t rows = shape.rows, k = shape.k, tiles = shape.tiles, groups = shape.groups;
  auto out = torch::empty({rows, tiles * kTile}, x.options());
  if (rows == 0) return out;
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
  const Int8Rows xq = quantize_rows<true>(x);
  auto dx_sum = xq.scale * xq.sum;  // dx * sum(xq), for the m term
  const int8_t* qp = xq.codes.data_ptr<int8_t>();
  const float* dp = xq.scale.data_ptr<float>();
  const float* sp = dx_sum.data_ptr<float>();
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  auto* op = out.data_ptr<at::BFloat16>();
  const int64_t n = tiles * kTile;
  for_each_tile(tiles, rows, [&](int64_t t, int64_t r0, int rb) {
    kInt8TileFns[rb](wp + t * groups * kBlockBytes, groups, qp + r0 * k, k, dp + r0 * groups,
                     sp + r0 * groups, op + r0 * n + t * kTile, n);
  });
#endif
  return out;
}

// The 4-bit product a layer takes at this row count: exact (q4_gemm) up to exact_max_rows,
// for decode steps of a few sequences, where it costs the same; activations rounded to int8
// (q4_q8_gemm) above, where that is 1.3-1.5x faster (benchmarks/linear_kernels.py).
torch::Tensor q4_linear(torch::Tensor x, torch::Tensor packed, int64_t exact_max_rows) {
  if (x.size(0) <= exact_max_rows || !q4_q8_gemm_available()) return q4_gemm(x, packed);
  return q4_q8_gemm(x, packed);
}
