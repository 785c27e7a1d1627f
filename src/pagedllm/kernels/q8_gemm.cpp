// x @ W.T for an 8-bit GGUF weight (Q8_0: w = d * q, q in -128..127, one d per 32 inputs) and
// a few bfloat16 rows, float32 results: the output head, whose 49152 x 576 weights are the
// default model's Q8_0 token embedding. It works the way llama.cpp multiplies Q8_0: each
// activation row is quantized to int8 per group of 32 (dx = max|x| / 127), and AVX512-VNNI
// multiplies 4 code pairs per 32-bit lane in one instruction, with int32 sums that are exact;
// d * dx is applied once per group. The activation rounding makes the logits approximate
// (like the int8 head it replaces), so the model recomputes its top candidates exactly.
// The instruction multiplies unsigned by signed bytes, so the weights are stored as
// q + 128 and the sum corrected by 128 * sum(x codes), known per row and group.
// Packed (q8_pack) into tiles of 16 output rows: per tile and group, 8 vectors of 64 bytes
// (lane i: output row i's codes for 4 consecutive inputs), then the 16 d as float16.
#include <vector>

#include "kernels.h"
#include "lowbit_gemm.h"

using namespace pagedllm::lowbit;

namespace {

constexpr int64_t kCodeBytes = kTile * kGroup;           // 512
constexpr int64_t kBlockBytes = kCodeBytes + kTile * 2;  // codes, then d (float16)
static_assert(kBlockBytes == pagedllm::kernel::kQ8PackedBlockBytes, "kernels.h names q8_pack's block size");

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)

template <int R>
void tile_rows(const uint8_t* tile, int64_t groups, const int8_t* xq, int64_t ldx,
               const float* dx, const int32_t* xq_sum, float* out, int64_t ldo) {
  __m512 total[R];
  for (int r = 0; r < R; ++r) total[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* block = tile + g * kBlockBytes;
    prefetch_ahead(block, kBlockBytes);
    __m512i acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_set1_epi32(-128 * xq_sum[r * groups + g]);
    for (int j = 0; j < kGroup / 4; ++j) {
      const __m512i w = _mm512_loadu_si512(block + 64 * j);
      for (int r = 0; r < R; ++r) {
        int32_t quad;
        std::memcpy(&quad, xq + r * ldx + g * kGroup + 4 * j, 4);
        acc[r] = _mm512_dpbusd_epi32(acc[r], w, _mm512_set1_epi32(quad));
      }
    }
    const __m512 d = load_halves(block + kCodeBytes);
    for (int r = 0; r < R; ++r) {
      const __m512 scale = _mm512_mul_ps(d, _mm512_set1_ps(dx[r * groups + g]));
      total[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r]), scale, total[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * ldo, total[r]);
}

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)

// AVX2, as llama.cpp multiplies Q8_0 by Q8_0: vpmaddubsw takes unsigned times signed bytes,
// so the weight codes go back to signed (xor 0x80), their magnitudes become the unsigned side
// and their signs move onto the activations (vpsignb). A pair sums to at most 2 x 128 x 127
// = 32512, within int16; vpmaddwd against ones widens to int32 for each 4-code quad.
template <int R>
void tile_rows(const uint8_t* tile, int64_t groups, const int8_t* xq, int64_t ldx,
               const float* dx, const int32_t*, float* out, int64_t ldo) {
  alignas(32) float total[R][kTile] = {};
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* block = tile + g * kBlockBytes;
    prefetch_ahead(block, kBlockBytes);
    for (int h = 0; h < 2; ++h) {
      __m256i acc[R];
      for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_si256();
      for (int j = 0; j < kGroup / 4; ++j) {
        const __m256i w = _mm256_xor_si256(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 64 * j + 32 * h)), flip);
        const __m256i magnitude = _mm256_sign_epi8(w, w);
        for (int r = 0; r < R; ++r) {
          int32_t quad;
          std::memcpy(&quad, xq + r * ldx + g * kGroup + 4 * j, 4);
          const __m256i signed_x = _mm256_sign_epi8(_mm256_set1_epi32(quad), w);
          acc[r] = _mm256_add_epi32(acc[r], _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, signed_x), ones));
          in_register(acc[r]);
        }
      }
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + kCodeBytes + 16 * h)));
      for (int r = 0; r < R; ++r) {
        const __m256 scale = _mm256_mul_ps(d, _mm256_set1_ps(dx[r * groups + g]));
        _mm256_store_ps(total[r] + 8 * h,
                        _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[r]), scale, _mm256_load_ps(total[r] + 8 * h)));
      }
    }
  }
  for (int r = 0; r < R; ++r) std::memcpy(out + r * ldo, total[r], sizeof(total[r]));
}

#else

// Plain C++ (every build without AVX512-VNNI or AVX2): each group's weight codes unpacked to an
// input-major [32][16] array first, so the inner loop over the tile's 16 output rows
// vectorises at whatever width the target has.
template <int R>
void tile_rows(const uint8_t* tile, int64_t groups, const int8_t* xq, int64_t ldx,
               const float* dx, const int32_t*, float* out, int64_t ldo) {
  alignas(64) float total[R][kTile] = {};
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* block = tile + g * kBlockBytes;
    alignas(64) int16_t w[kGroup][kTile];
    for (int64_t c = 0; c < kGroup; ++c)
      for (int64_t i = 0; i < kTile; ++i) w[c][i] = static_cast<int16_t>(block[64 * (c / 4) + 4 * i + c % 4]) - 128;
    alignas(64) float d[kTile];
    const auto* halves = reinterpret_cast<const pagedllm::f16*>(block + kCodeBytes);
    for (int64_t i = 0; i < kTile; ++i) d[i] = static_cast<float>(halves[i]);
    for (int r = 0; r < R; ++r) {
      alignas(64) int32_t acc[kTile] = {};
      const int8_t* xr = xq + r * ldx + g * kGroup;
      for (int64_t c = 0; c < kGroup; ++c)
        for (int64_t i = 0; i < kTile; ++i) acc[i] += static_cast<int32_t>(xr[c]) * w[c][i];
      const float scale = dx[r * groups + g];
      for (int64_t i = 0; i < kTile; ++i) total[r][i] += static_cast<float>(acc[i]) * (d[i] * scale);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int64_t i = 0; i < kTile; ++i) out[r * ldo + i] = total[r][i];
}

#endif  // __AVX512VNNI__

// Each branch above defines tile_rows<R> for R = 1..kRowBlock activation rows.
using TileFn = decltype(&tile_rows<1>);
constexpr TileFn kTileFns[kRowBlock + 1] = {nullptr, tile_rows<1>, tile_rows<2>, tile_rows<3>,
                                            tile_rows<4>, tile_rows<5>, tile_rows<6>,
                                            tile_rows<7>, tile_rows<8>};

}  // namespace

namespace pagedllm::kernel {

void q8_pack(const int8_t* src, const f16* dsrc, int64_t n, int64_t k, uint8_t* dst) {
  const int64_t groups = k / kGroup;
  parallel_for(0, n / kTile, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t g = 0; g < groups; ++g) {
        uint8_t* block = dst + (t * groups + g) * kBlockBytes;
        for (int64_t i = 0; i < kTile; ++i) {
          const int64_t row = t * kTile + i;
          for (int64_t c4 = 0; c4 < kGroup; ++c4)
            block[64 * (c4 / 4) + 4 * i + c4 % 4] = static_cast<uint8_t>(src[row * k + g * kGroup + c4] + 128);
          std::memcpy(block + kCodeBytes + 2 * i, dsrc + row * groups + g, 2);
        }
      }
  });
}

void q8_gemm(const bf16* x, const uint8_t* wp, int64_t rows, int64_t k, int64_t n, float* op) {
  if (rows == 0) return;
  const int64_t groups = k / kGroup, tiles = n / kTile;
  const Int8Rows xq = quantize_rows<false>(x, rows, k);
  const int8_t* qp = xq.codes.get();
  const float* dp = xq.scale.get();
  const int32_t* sp = xq.sum.get();
  for_each_tile(tiles, rows, [&](int64_t t, int64_t r0, int rb) {
    kTileFns[rb](wp + t * groups * kBlockBytes, groups, qp + r0 * k, k, dp + r0 * groups,
                 sp + r0 * groups, op + r0 * n + t * kTile, n);
  });
}

// Each row's `top` largest logits recomputed exactly (the float32 sum of hidden times code *
// d, as dequantized rows give), since the int8-rounded activations can swap near-equal
// candidates. One pass over each row finds them; nothing is sorted.
void q8_refine_top(float* lp, const float* hp, const int8_t* cp, const float* dp, int64_t rows,
                   int64_t n, int64_t k, int64_t top) {
  const int64_t groups = k / kGroup;
  parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<int64_t> best(top);
    std::vector<float> best_value(top);
    for (int64_t r = begin; r < end; ++r) {
      float* row = lp + r * n;
      // The top candidates in one pass: a value enters only if it beats the smallest kept.
      for (int64_t j = 0; j < top; ++j) best[j] = j, best_value[j] = row[j];
      int64_t low = std::min_element(best_value.begin(), best_value.end()) - best_value.begin();
      for (int64_t i = top; i < n; ++i) {
        if (!(row[i] > best_value[low])) continue;
        best[low] = i;
        best_value[low] = row[i];
        low = std::min_element(best_value.begin(), best_value.end()) - best_value.begin();
      }
      for (int64_t j = 0; j < top; ++j) {
        const int64_t v = best[j];
        float sum = 0.0f;
        for (int64_t i = 0; i < k; ++i)
          sum += hp[r * k + i] * (static_cast<float>(cp[v * k + i]) * dp[v * groups + i / kGroup]);
        row[v] = sum;
      }
    }
  });
}

}  // namespace pagedllm::kernel
