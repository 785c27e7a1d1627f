// x @ W.T for GGUF Q6_K weights as the file holds them: w = d * sc * (q - 32), q in 0..63,
// one int8 scale sc per 16 inputs under one float16 d per 256 inputs and row: 6.56 bits a
// weight, where rounding them to Q8_0 (the 8-bit kernel's form) took 8.5. A Q4_K_M file keeps
// its output head, half its v projections and half its down projections in Q6_K, about a
// quarter of its bytes, and decode reads every byte once a token.
// Multiplied as llama.cpp multiplies Q6_K by Q8: each activation row rounded to int8 per
// group of 32 (quantize_rows), integer dot products per 16 inputs (AVX512-VNNI; AVX2
// vpmaddubsw; plain C++ on the portable level), d * sc * dx applied per 16:
//   sum x*w = d * sc * dx * (xq . q - 32 * sum(xq)).
// Packed (q6_pack) per tile of 16 output rows and block of 256 inputs:
// - per group of 32 inputs, four 64-byte vectors of the codes' low 4 bits laid out as the
//   4-bit kernels lay out codes (q4_layout.h: lane i, 8 codes of row i at code_shift's bits),
//   then two vectors of their high 2 bits: vector p serves code vectors 2p and 2p + 1 (the
//   16 inputs of one scale); byte b of lane i holds, for code vector 2p, the high bits of
//   byte b's low-nibble code at bits 4-5 and of its high-nibble code at bits 6-7, and for
//   2p + 1 the same at bits 0-1 and 2-3, so one shift and one mask put them above the nibble;
// - then the 16 int8 scales of each of the block's 16 sub-groups, then d per row (float16).
#include "amx_tiles.h"
#include "kernels.h"
#include "lowbit_gemm.h"
#include "q4_layout.h"

#include <vector>

using namespace pagedllm::lowbit;
using pagedllm::q4::code_shift;

namespace {

constexpr int64_t kGroupsPerBlock = 8;                        // 256 inputs
constexpr int64_t kLowBytes = kTile * kGroup / 2;             // 256: 4 low bits a code
constexpr int64_t kGroupBytes = kLowBytes + kTile * kGroup / 4;  // + 128: 2 high bits a code
constexpr int64_t kScaleOffset = kGroupsPerBlock * kGroupBytes;  // 3072: sc [16][16] int8
constexpr int64_t kDOffset = kScaleOffset + 2 * kGroupsPerBlock * kTile;  // 3328: d [16]
constexpr int64_t kBlockBytes = kDOffset + 2 * kTile;         // 3360
static_assert(kBlockBytes == pagedllm::kernel::kQ6PackedBlockBytes, "kernels.h names q6_pack's block size");

// Bit of the high-bits plane, within lane i's 32 bits, holding bit 0 of the high 2 bits of
// code c (0..7) of code vector j.
inline int high_shift(int j, int c) {
  const int byte = code_shift(c) / 8, high_nibble = code_shift(c) / 4 % 2;
  return 8 * byte + (j % 2 == 0 ? 4 : 0) + 2 * high_nibble;
}

// The activation codes' sum per 16 inputs, [M, K / 16]: the -32 offset's share of each scale
// (at most 16 x 127 in magnitude: int16, so the AVX2 tile reads a group's two as one pair).
// A plain loop: torch's integer sum cost ~45 us a call, a millisecond a decode step.
std::unique_ptr<int16_t[]> sums_of_16(const int8_t* c, int64_t count) {
  const int64_t sums = count / 16;
  auto out = pagedllm::scratch<int16_t>(sums);
  int16_t* o = out.get();
  for (int64_t i = 0; i < sums; ++i) {
    int32_t sum = 0;
    for (int e = 0; e < 16; ++e) sum += c[16 * i + e];
    o[i] = static_cast<int16_t>(sum);
  }
  return out;
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)

constexpr bool kInterleavedCodes = true;

// 16 int8 scales (one sub-group of the tile's rows) as int32.
inline __m512i load_scales(const uint8_t* p) {
  return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// R rows of int8 activations times one tile. Per sub-group of 16 inputs: its two code vectors
// with their high bits put back, two dpbusd each (low- and high-nibble codes against the
// interleaved activation codes), started from -32 * sum(xq); the two sub-groups' sums times
// their scales added as integers (at most 2 x 128 x 16 x 32 x 127, within int32), so a group
// costs one conversion to float.
template <int R>
void tile_rows(const uint8_t* tile, int64_t groups, const int8_t* xq, int64_t ldx,
               const float* dx, const int16_t* xsum16, float* out, int64_t ldo) {
  __m512 total[R];
  for (int r = 0; r < R; ++r) total[r] = _mm512_setzero_ps();
  const __m512i nibble = _mm512_set1_epi8(0x0F), high = _mm512_set1_epi8(0x30);
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* block = tile + g / kGroupsPerBlock * kBlockBytes;
    const uint8_t* codes = block + g % kGroupsPerBlock * kGroupBytes;
    prefetch_ahead(tile + g * (kBlockBytes / kGroupsPerBlock), kBlockBytes / kGroupsPerBlock);
    __m512i sum[R];
    for (int s = 0; s < 2; ++s) {
      // Two chains per row (low- and high-nibble codes): one would wait on dpbusd's latency
      // when the rows are few.
      __m512i acc[R], acc_high[R];
      for (int r = 0; r < R; ++r) {
        acc[r] = _mm512_set1_epi32(-32 * xsum16[r * 2 * groups + 2 * g + s]);
        acc_high[r] = _mm512_setzero_si512();
      }
      const __m512i plane = _mm512_loadu_si512(codes + kLowBytes + 64 * s);
      for (int h = 0; h < 2; ++h) {
        const int j = 2 * s + h;
        const __m512i v = _mm512_loadu_si512(codes + 64 * j);
        const __m512i low_top = h == 0 ? plane : _mm512_slli_epi32(plane, 4);
        const __m512i high_top = h == 0 ? _mm512_srli_epi32(plane, 2) : _mm512_slli_epi32(plane, 2);
        const __m512i low = _mm512_or_si512(_mm512_and_si512(v, nibble), _mm512_and_si512(low_top, high));
        const __m512i hi = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(v, 4), nibble),
                                           _mm512_and_si512(high_top, high));
        const int8_t* x = xq + g * kGroup + 8 * j;
        for (int r = 0; r < R; ++r) {
          acc[r] = _mm512_dpbusd_epi32(acc[r], low, broadcast_quad(x + r * ldx));
          acc_high[r] = _mm512_dpbusd_epi32(acc_high[r], hi, broadcast_quad(x + r * ldx + 4));
        }
      }
      const __m512i scale = load_scales(block + kScaleOffset + kTile * (2 * (g % kGroupsPerBlock) + s));
      for (int r = 0; r < R; ++r) {
        const __m512i scaled = _mm512_mullo_epi32(_mm512_add_epi32(acc[r], acc_high[r]), scale);
        sum[r] = s == 0 ? scaled : _mm512_add_epi32(sum[r], scaled);
      }
    }
    const __m512 d = load_halves(block + kDOffset);
    for (int r = 0; r < R; ++r)
      total[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[r]), _mm512_mul_ps(d, _mm512_set1_ps(dx[r * groups + g])),
                                 total[r]);
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * ldo, total[r]);
}

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)

constexpr bool kInterleavedCodes = true;

inline __m256i broadcast_quad8(const int8_t* x) {
  int32_t quad;
  std::memcpy(&quad, x, 4);
  return _mm256_set1_epi32(quad);
}

// A group's 16 scales of one half (output rows 8 half .. 8 half + 7) for its two sub-groups,
// as int16 pairs: lane i holds (sc[2g][i], sc[2g + 1][i]).
inline __m256i scale_pairs(const uint8_t* block, int64_t g, int half) {
  const uint8_t* sc = block + kScaleOffset + kTile * 2 * (g % kGroupsPerBlock) + 8 * half;
  const __m128i s0 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc));
  const __m128i s1 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc + kTile));
  return _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(s0, s1));
}

// Code vector j = 2s + h of a group (codes: its bytes), one half (output rows 8 half ..
// 8 half + 7), with the high bits put back above the nibbles: the low-nibble codes and the
// high-nibble codes as unsigned bytes 0..63.
inline void six_bit_codes(const uint8_t* codes, int s, int h, int half, __m256i& low, __m256i& hi) {
  const __m256i nibble = _mm256_set1_epi8(0x0F), high = _mm256_set1_epi8(0x30);
  const __m256i plane = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + kLowBytes + 64 * s + 32 * half));
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + 64 * (2 * s + h) + 32 * half));
  const __m256i low_top = h == 0 ? plane : _mm256_slli_epi32(plane, 4);
  const __m256i high_top = h == 0 ? _mm256_srli_epi32(plane, 2) : _mm256_slli_epi32(plane, 2);
  low = _mm256_or_si256(_mm256_and_si256(v, nibble), _mm256_and_si256(low_top, high));
  hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(v, 4), nibble), _mm256_and_si256(high_top, high));
}

// acc + (low . x0 + hi . x1) * scale: a code vector's two int16 pair sums (at most 32004)
// widened against the sub-group's scale pairs.
inline __m256i add_scaled_dot(__m256i acc, __m256i low, __m256i hi, __m256i x0, __m256i x1, __m256i scale) {
  const __m256i sum16 = _mm256_add_epi16(_mm256_maddubs_epi16(low, x0), _mm256_maddubs_epi16(hi, x1));
  return _mm256_add_epi32(acc, _mm256_madd_epi16(sum16, scale));
}

// A group's integer sums into a row's float32 totals: total + acc * (d * dx), in that order
// (the same float operations whichever tile takes the row).
inline __m256 add_group_total(__m256i acc, __m256 d, float dx, __m256 total) {
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc), _mm256_mul_ps(d, _mm256_set1_ps(dx)), total);
}

// Rows a pass of the AVX2 tile takes, both halves of the tile at once: 2 x 4 chains in
// registers, each activation broadcast serving both halves (of 2-8 rows a pass, 4 or more
// measured best; docs/benchmarks/log.md, 2026-12-07).
constexpr int kQ6RowsPerPass = 4;

// As the AVX-512 tile, in two 256-bit halves (output rows 0-7 and 8-15 of the tile), with
// vpmaddubsw: codes 0..63 times activations -127..127 sum in pairs to at most 16002, the low-
// and high-nibble pairs to 32004, within int16. The sub-group's scale is folded in where those
// pairs widen to int32 (vpmaddwd against the scale, at most 2 x 32004 x 128 a step: the group
// sums within int32), and each row's chain starts from the -32 offset of both sub-groups
// (vpmaddwd of -32 * sc, within int16, against the pair of activation sums), so a group costs
// one chain per row and half and one conversion to float.
template <int R>
void tile_rows(const uint8_t* tile, int64_t groups, const int8_t* xq, int64_t ldx,
               const float* dx, const int16_t* xsum16, float* out, int64_t ldo) {
  if constexpr (R > kQ6RowsPerPass) {
    // Rows are independent, so each row's result is the same as when alone; the second
    // pass reads the tile from cache.
    tile_rows<kQ6RowsPerPass>(tile, groups, xq, ldx, dx, xsum16, out, ldo);
    tile_rows<R - kQ6RowsPerPass>(tile, groups, xq + kQ6RowsPerPass * ldx, ldx, dx + kQ6RowsPerPass * groups,
                                  xsum16 + kQ6RowsPerPass * 2 * groups, out + kQ6RowsPerPass * ldo, ldo);
  } else {
    alignas(32) float total[R][kTile] = {};
    const __m256i minus32 = _mm256_set1_epi16(-32);
    for (int64_t g = 0; g < groups; ++g) {
      const uint8_t* block = tile + g / kGroupsPerBlock * kBlockBytes;
      const uint8_t* codes = block + g % kGroupsPerBlock * kGroupBytes;
      prefetch_ahead(tile + g * (kBlockBytes / kGroupsPerBlock), kBlockBytes / kGroupsPerBlock);
      __m256i pairs[2], acc[2][R];
      for (int half = 0; half < 2; ++half) {
        pairs[half] = scale_pairs(block, g, half);
        const __m256i offset = _mm256_mullo_epi16(pairs[half], minus32);
        for (int r = 0; r < R; ++r) {
          int32_t sums;  // the two sub-groups' activation sums, adjacent int16
          std::memcpy(&sums, xsum16 + r * 2 * groups + 2 * g, 4);
          acc[half][r] = _mm256_madd_epi16(offset, _mm256_set1_epi32(sums));
        }
      }
      for (int s = 0; s < 2; ++s) {
        for (int h = 0; h < 2; ++h) {
          const int j = 2 * s + h;
          __m256i low[2], hi[2];
          for (int half = 0; half < 2; ++half) six_bit_codes(codes, s, h, half, low[half], hi[half]);
          const int8_t* x = xq + g * kGroup + 8 * j;
          for (int r = 0; r < R; ++r) {
            const __m256i x0 = broadcast_quad8(x + r * ldx), x1 = broadcast_quad8(x + r * ldx + 4);
            for (int half = 0; half < 2; ++half) {
              // Lane i's pair (sc, sc) of sub-group s.
              const __m256i scale = s == 0 ? _mm256_shufflehi_epi16(_mm256_shufflelo_epi16(pairs[half], 0xA0), 0xA0)
                                           : _mm256_shufflehi_epi16(_mm256_shufflelo_epi16(pairs[half], 0xF5), 0xF5);
              acc[half][r] = add_scaled_dot(acc[half][r], low[half], hi[half], x0, x1, scale);
              in_register(acc[half][r]);
            }
          }
        }
      }
      for (int half = 0; half < 2; ++half) {
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + kDOffset + 16 * half)));
        for (int r = 0; r < R; ++r) {
          float* t = total[r] + 8 * half;
          _mm256_storeu_ps(t, add_group_total(acc[half][r], d, dx[r * groups + g], _mm256_loadu_ps(t)));
        }
      }
    }
    for (int r = 0; r < R; ++r) std::memcpy(out + r * ldo, total[r], sizeof(total[r]));
  }
}

// A prefill's rows (from kUnpackedMinRows) take each tile whole, block by block: the block's
// codes are put together once (unpack_block: the 6-bit codes as bytes, the scales as the
// vpmaddwd operands, the -32 offsets), then every pass of 4 rows reads them ready, while
// they sit in L1, instead of unpacking them again on each pass (the tile above spends about
// a quarter of its instructions there, and GCC spills its chains doing it). The integer sums
// and their float order per row are the tile's own, so a row's result is the same bits
// whichever way it is taken (tests/test_k_quant_kernels.py).
#define PAGEDLLM_Q6_UNPACKED_BLOCKS 1
constexpr int64_t kUnpackedMinRows = 48;  // below, the unpacking costs about what it saves
// An unpacked block: per group, code vector j and half, the low-nibble codes' 32 bytes, then
// the high-nibble codes' (512 bytes a group); per group, sub-group and half, the scale pairs
// (sc, sc) as int16; per group and half, the offsets (-32 sc0, -32 sc1) as int16.
constexpr int64_t kUnpackedGroupCodes = 512;
constexpr int64_t kUnpackedScales = kGroupsPerBlock * kUnpackedGroupCodes;
constexpr int64_t kUnpackedOffsets = kUnpackedScales + kGroupsPerBlock * 4 * 32;
constexpr int64_t kUnpackedBytes = kUnpackedOffsets + kGroupsPerBlock * 2 * 32;

inline void unpack_block(const uint8_t* block, uint8_t* out) {
  const __m256i minus32 = _mm256_set1_epi16(-32);
  for (int64_t g = 0; g < kGroupsPerBlock; ++g) {
    const uint8_t* codes = block + g * kGroupBytes;
    for (int s = 0; s < 2; ++s)
      for (int h = 0; h < 2; ++h) {
        const int j = 2 * s + h;
        for (int half = 0; half < 2; ++half) {
          __m256i low, hi;
          six_bit_codes(codes, s, h, half, low, hi);
          __m256i* o = reinterpret_cast<__m256i*>(out + g * kUnpackedGroupCodes + 128 * j + 64 * half);
          _mm256_store_si256(o, low);
          _mm256_store_si256(o + 1, hi);
        }
      }
    for (int half = 0; half < 2; ++half) {
      const __m256i pairs = scale_pairs(block, g, half);
      __m256i* sc = reinterpret_cast<__m256i*>(out + kUnpackedScales + g * 128 + 32 * half);
      _mm256_store_si256(sc, _mm256_shufflehi_epi16(_mm256_shufflelo_epi16(pairs, 0xA0), 0xA0));
      _mm256_store_si256(sc + 2, _mm256_shufflehi_epi16(_mm256_shufflelo_epi16(pairs, 0xF5), 0xF5));
      _mm256_store_si256(reinterpret_cast<__m256i*>(out + kUnpackedOffsets + g * 64 + 32 * half),
                         _mm256_mullo_epi16(pairs, minus32));
    }
  }
}

// R rows (at most 4) times one unpacked block (u; d from the packed block), added to
// total[r][16]. xq, dx, xsum16: row 0's at the block, rows ldx, groups, 2 groups apart.
template <int R>
void unpacked_block_rows(const uint8_t* u, const uint8_t* block, int64_t groups, const int8_t* xq,
                         int64_t ldx, const float* dx, const int16_t* xsum16, float* total) {
  for (int64_t g = 0; g < kGroupsPerBlock; ++g) {
    __m256i acc[2][R];
    for (int half = 0; half < 2; ++half) {
      const __m256i offset = _mm256_load_si256(reinterpret_cast<const __m256i*>(u + kUnpackedOffsets + g * 64 + 32 * half));
      for (int r = 0; r < R; ++r) {
        int32_t sums;  // the two sub-groups' activation sums, adjacent int16
        std::memcpy(&sums, xsum16 + r * 2 * groups + 2 * g, 4);
        acc[half][r] = _mm256_madd_epi16(offset, _mm256_set1_epi32(sums));
      }
    }
    for (int j = 0; j < 4; ++j) {
      const uint8_t* codes = u + g * kUnpackedGroupCodes + 128 * j;
      __m256i low[2], hi[2];
      for (int half = 0; half < 2; ++half) {
        low[half] = _mm256_load_si256(reinterpret_cast<const __m256i*>(codes + 64 * half));
        hi[half] = _mm256_load_si256(reinterpret_cast<const __m256i*>(codes + 64 * half + 32));
      }
      const int8_t* x = xq + g * kGroup + 8 * j;
      for (int r = 0; r < R; ++r) {
        const __m256i x0 = broadcast_quad8(x + r * ldx), x1 = broadcast_quad8(x + r * ldx + 4);
        for (int half = 0; half < 2; ++half) {
          const __m256i scale = _mm256_load_si256(
              reinterpret_cast<const __m256i*>(u + kUnpackedScales + g * 128 + 64 * (j / 2) + 32 * half));
          acc[half][r] = add_scaled_dot(acc[half][r], low[half], hi[half], x0, x1, scale);
          in_register(acc[half][r]);
        }
      }
    }
    for (int half = 0; half < 2; ++half) {
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + kDOffset + 16 * half)));
      for (int r = 0; r < R; ++r) {
        float* t = total + r * kTile + 8 * half;
        _mm256_storeu_ps(t, add_group_total(acc[half][r], d, dx[r * groups + g], _mm256_loadu_ps(t)));
      }
    }
  }
}

constexpr decltype(&unpacked_block_rows<1>) kUnpackedBlockFns[kQ6RowsPerPass + 1] = {
    nullptr, unpacked_block_rows<1>, unpacked_block_rows<2>, unpacked_block_rows<3>, unpacked_block_rows<4>};

// All `rows` rows times one tile, block by block, 4 rows a pass.
void unpacked_tile_rows(const uint8_t* tile, int64_t groups, int64_t rows, const int8_t* xq,
                        int64_t ldx, const float* dx, const int16_t* xsum16, float* out, int64_t ldo) {
  thread_local std::vector<float> totals;
  totals.assign(rows * kTile, 0.0f);
  alignas(64) uint8_t u[kUnpackedBytes];
  constexpr int64_t kGroupBytesWithScales = kBlockBytes / kGroupsPerBlock;
  for (int64_t b = 0; b < groups / kGroupsPerBlock; ++b) {
    const uint8_t* block = tile + b * kBlockBytes;
    for (int64_t j = 0; j < kGroupsPerBlock; ++j)
      prefetch_ahead(block + j * kGroupBytesWithScales, kGroupBytesWithScales);
    unpack_block(block, u);
    const int64_t g0 = b * kGroupsPerBlock;
    for (int64_t r0 = 0; r0 < rows; r0 += kQ6RowsPerPass) {
      const int64_t R = std::min<int64_t>(kQ6RowsPerPass, rows - r0);
      kUnpackedBlockFns[R](u, block, groups, xq + r0 * ldx + g0 * kGroup, ldx, dx + r0 * groups + g0,
                           xsum16 + r0 * 2 * groups + 2 * g0, totals.data() + r0 * kTile);
    }
  }
  for (int64_t r = 0; r < rows; ++r) std::memcpy(out + r * ldo, totals.data() + r * kTile, kTile * sizeof(float));
}

#else

constexpr bool kInterleavedCodes = false;

// Plain C++: each group's codes unpacked to an input-major [32][16] array of q - 32 first, so
// the inner loop over the tile's 16 output rows vectorises at whatever width the target has.
template <int R>
void tile_rows(const uint8_t* tile, int64_t groups, const int8_t* xq, int64_t ldx,
               const float* dx, const int16_t*, float* out, int64_t ldo) {
  alignas(64) float total[R][kTile] = {};
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* block = tile + g / kGroupsPerBlock * kBlockBytes;
    const uint8_t* codes = block + g % kGroupsPerBlock * kGroupBytes;
    alignas(64) int16_t w[kGroup][kTile];
    for (int j = 0; j < 4; ++j)
      for (int64_t i = 0; i < kTile; ++i) {
        uint32_t lane, plane;
        std::memcpy(&lane, codes + 64 * j + 4 * i, 4);
        std::memcpy(&plane, codes + kLowBytes + 64 * (j / 2) + 4 * i, 4);
        for (int c = 0; c < 8; ++c)
          w[8 * j + c][i] = static_cast<int16_t>(((lane >> code_shift(c)) & 0xF) |
                                                 (((plane >> high_shift(j, c)) & 0x3) << 4)) - 32;
      }
    const auto* halves = reinterpret_cast<const pagedllm::f16*>(block + kDOffset);
    alignas(64) float scale[2][kTile];
    for (int s = 0; s < 2; ++s)
      for (int64_t i = 0; i < kTile; ++i)
        scale[s][i] = static_cast<float>(halves[i]) *
                      static_cast<int8_t>(block[kScaleOffset + kTile * (2 * (g % kGroupsPerBlock) + s) + i]);
    for (int r = 0; r < R; ++r) {
      const int8_t* xr = xq + r * ldx + g * kGroup;
      for (int s = 0; s < 2; ++s) {
        alignas(64) int32_t acc[kTile] = {};
        for (int64_t c = 16 * s; c < 16 * s + 16; ++c)
          for (int64_t i = 0; i < kTile; ++i) acc[i] += static_cast<int32_t>(xr[c]) * w[c][i];
        const float sx = dx[r * groups + g];
        for (int64_t i = 0; i < kTile; ++i) total[r][i] += static_cast<float>(acc[i]) * (scale[s][i] * sx);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int64_t i = 0; i < kTile; ++i) out[r * ldo + i] = total[r][i];
}

#endif

#if defined(PAGEDLLM_AMX_TILES)
// Group g of a tile as an AMX B tile (amx_tiles.h): w = d * sc * (q - 32) rounded to bfloat16,
// row 4j + p holding codes 2p and 2p + 1 of code vector j (inputs 8j + 2p, 8j + 2p + 1).
inline void q6_b_tile(const uint8_t* tile, int64_t g, uint8_t* b) {
  const uint8_t* block = tile + g / kGroupsPerBlock * kBlockBytes;
  const uint8_t* codes = block + g % kGroupsPerBlock * kGroupBytes;
  prefetch_ahead(tile + g * (kBlockBytes / kGroupsPerBlock), kBlockBytes / kGroupsPerBlock);
  const __m512 d = load_halves(block + kDOffset);
  const __m512i nibble = _mm512_set1_epi32(0xF), two_bits = _mm512_set1_epi32(3);
  const __m512i offset = _mm512_set1_epi32(32);
  for (int j = 0; j < 4; ++j) {
    const __m512i v = _mm512_loadu_si512(codes + 64 * j);
    const __m512i plane = _mm512_loadu_si512(codes + kLowBytes + 64 * (j / 2));
    const uint8_t* sc = block + kScaleOffset + kTile * (2 * (g % kGroupsPerBlock) + j / 2);
    const __m512 scale = _mm512_mul_ps(
        d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc)))));
    for (int p = 0; p < 4; ++p) {
      __m512i w[2];
      for (int h = 0; h < 2; ++h) {
        const int c = 2 * p + h;
        const __m512i low = _mm512_and_si512(_mm512_srli_epi32(v, code_shift(c)), nibble);
        const __m512i top = _mm512_and_si512(_mm512_srli_epi32(plane, high_shift(j, c)), two_bits);
        const __m512i q = _mm512_sub_epi32(_mm512_or_si512(low, _mm512_slli_epi32(top, 4)), offset);
        w[h] = pagedllm::amx::round_to_bf16_high(_mm512_mul_ps(scale, _mm512_cvtepi32_ps(q)));
      }
      _mm512_store_si512(b + 64 * (4 * j + p), _mm512_or_si512(_mm512_srli_epi32(w[0], 16), w[1]));
    }
  }
}
#endif

// Each branch above defines tile_rows<R> for R = 1..kRowBlock activation rows.
using TileFn = decltype(&tile_rows<1>);
constexpr TileFn kTileFns[kRowBlock + 1] = {nullptr, tile_rows<1>, tile_rows<2>, tile_rows<3>,
                                            tile_rows<4>, tile_rows<5>, tile_rows<6>,
                                            tile_rows<7>, tile_rows<8>};

}  // namespace

namespace pagedllm::kernel {

void q6_pack(const uint8_t* src, const int8_t* scp, const f16* dp, int64_t n, int64_t k, uint8_t* dst) {
  const int64_t groups = k / kGroup, blocks = groups / kGroupsPerBlock;
  parallel_for(0, n / kTile, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t b = 0; b < blocks; ++b) {
        uint8_t* block = dst + (t * blocks + b) * kBlockBytes;
        for (int64_t i = 0; i < kTile; ++i) {
          const int64_t row = t * kTile + i;
          for (int64_t gb = 0; gb < kGroupsPerBlock; ++gb) {
            const uint8_t* q = src + row * k + (b * kGroupsPerBlock + gb) * kGroup;
            uint8_t* group = block + gb * kGroupBytes;
            uint32_t planes[2] = {0, 0};
            for (int j = 0; j < 4; ++j) {
              uint32_t lane = 0;
              for (int c8 = 0; c8 < 8; ++c8) {
                lane |= static_cast<uint32_t>(q[8 * j + c8] & 0xF) << code_shift(c8);
                planes[j / 2] |= static_cast<uint32_t>(q[8 * j + c8] >> 4) << high_shift(j, c8);
              }
              std::memcpy(group + 64 * j + 4 * i, &lane, 4);
            }
            for (int p = 0; p < 2; ++p) std::memcpy(group + kLowBytes + 64 * p + 4 * i, &planes[p], 4);
            for (int s = 0; s < 2; ++s)
              block[kScaleOffset + kTile * (2 * gb + s) + i] =
                  static_cast<uint8_t>(scp[row * 2 * groups + 2 * (b * kGroupsPerBlock + gb) + s]);
          }
          std::memcpy(block + kDOffset + 2 * i, dp + row * blocks + b, 2);
        }
      }
  });
}

void q6_gemm(const bf16* x, const uint8_t* wp, int64_t rows, int64_t k, int64_t n, float* op) {
  if (rows == 0) return;
  const int64_t groups = k / kGroup, tiles = n / kTile;
  const Int8Rows xq = quantize_rows<kInterleavedCodes>(x, rows, k);
  const auto xsum16 = sums_of_16(xq.codes.get(), rows * k);
  const int8_t* qp = xq.codes.get();
  const float* dp = xq.scale.get();
  const int16_t* sp = xsum16.get();
  const int64_t tile_bytes = groups / kGroupsPerBlock * kBlockBytes;
#if defined(PAGEDLLM_Q6_UNPACKED_BLOCKS)
  if (rows >= kUnpackedMinRows) {
    for_each_whole_tile(tiles, rows, [&](int64_t t) {
      unpacked_tile_rows(wp + t * tile_bytes, groups, rows, qp, k, dp, sp, op + t * kTile, n);
    });
    return;
  }
#endif
  for_each_tile(tiles, rows, [&](int64_t t, int64_t r0, int rb) {
    kTileFns[rb](wp + t * tile_bytes, groups, qp + r0 * k, k, dp + r0 * groups, sp + r0 * 2 * groups,
                 op + r0 * n + t * kTile, n);
  });
}

void q6_bf16_gemm(const bf16* x, const uint8_t* wp, int64_t rows, int64_t k, int64_t n, bf16* out) {
  if (rows == 0) return;
  const int64_t groups = k / kGroup, tiles = n / kTile;
#if defined(PAGEDLLM_AMX_TILES)
  if (amx_tiles_usable()) {
    const int64_t tile_bytes = groups / kGroupsPerBlock * kBlockBytes;
    pagedllm::amx::bf16_gemm(tiles, groups, x, k, rows, out, n, [&](int64_t t, int64_t g, uint8_t* b) {
      q6_b_tile(wp + t * tile_bytes, g, b);
    });
    return;
  }
#endif
  // No tiles: the int8-activation product, rounded to bfloat16.
  const auto wide = pagedllm::scratch<float>(rows * n);
  q6_gemm(x, wp, rows, k, n, wide.get());
  for (int64_t i = 0; i < rows * n; ++i) out[i] = bf16(wide[i]);
}

}  // namespace pagedllm::kernel
