// q4_gemm's exact product on the AMX tiles (Intel Xeons since Sapphire Rapids), for the
// avx512 build; used where the caller says the process holds the tiles' state (kernels/cpu.py
// asks Linux for it). Included by q4_gemm.cpp only.
//
// The same arithmetic as the AVX-512 exact tile (q4_tiles_avx512.h): a code q becomes the
// bfloat16 128 + q, and per group of 32 inputs sum x*w = d * (x . (128 + q)) + (m - 128 d) *
// sum(x), the dot products in float32 over exact bfloat16 products. What changes is who
// multiplies: on Intel's cores vdpbf16ps issues every other cycle, so 8 rows of a batched
// decode step cost the AVX-512 tile 2.5x the int8 one; one TDPBF16PS multiplies up to 16 rows
// by a whole group (16 x 32 x 16) at once.
//
// Per tile of 16 output rows and group: the four code vectors become the 16 rows of the
// B tile (row p: inputs 2p and 2p + 1 of the 16 output rows, bfloat16 pairs: exactly what
// codes_pair<P> of vector j makes for p = 4j + P), written once and used by every block of
// 16 activation rows; A is 16 rows x 32 inputs of x read in place; C (rows x 16 float32) is
// read out for each group, since each group has its own scale.
#pragma once
#include "amx_tiles.h"
#include "q4_tiles_avx512.h"

#if defined(PAGEDLLM_AMX_TILES)

namespace pagedllm::q4 {

using pagedllm::amx::kAmxRows;

constexpr int kAmxGroups = 8;  // groups whose B tiles are written before any is multiplied

// The palette-1 tile configuration. Groups alternate between two sets of tiles, so that one
// group's product does not wait for the previous one's: C 0 / 3, A 1 / 4, B 2 / 5 for blocks
// of 16 activation rows; the last, shorter block: C 6, A 7.
__attribute__((target("amx-tile"))) inline void configure_tiles(int last_rows) {
  pagedllm::amx::TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.colsb[t] = 64;
    config.rows[t] = kAmxRows;
  }
  config.rows[6] = config.rows[7] = static_cast<uint8_t>(last_rows > 0 ? last_rows : kAmxRows);
  pagedllm::amx::load_config(config);
}

// C = A . B for group g's B tile (b), one block of activation rows (x at its first row and
// the group's first input, k apart), C stored to c [rows][16] float32. `last`: the shorter
// block's tiles.
__attribute__((target("amx-tile,amx-bf16"))) inline void group_product(
    int g, bool last, const uint8_t* b, const pagedllm::bf16* x, int64_t k, float* c) {
  if (g % 2 == 0) _tile_loadd(2, b, 64);
  else _tile_loadd(5, b, 64);
  if (last) {
    _tile_zero(6);
    _tile_loadd(7, x, k * 2);
    if (g % 2 == 0) _tile_dpbf16ps(6, 7, 2);
    else _tile_dpbf16ps(6, 7, 5);
    _tile_stored(6, c, 64);
  } else if (g % 2 == 0) {
    _tile_zero(0);
    _tile_loadd(1, x, k * 2);
    _tile_dpbf16ps(0, 1, 2);
    _tile_stored(0, c, 64);
  } else {
    _tile_zero(3);
    _tile_loadd(4, x, k * 2);
    _tile_dpbf16ps(3, 4, 5);
    _tile_stored(3, c, 64);
  }
}

// Per thread: the B tiles of kAmxGroups groups, and their products for one row block.
struct AmxScratch {
  alignas(64) uint8_t b[kAmxGroups][1024];
  alignas(64) float c[kAmxGroups][kAmxRows * kTile];
};

// One tile of 16 output rows times all `rows` activation rows, into total [rows][16] float32
// (the calling thread's scratch). Groups go kAmxGroups at a time: first every group's codes
// become its B tile in memory, then each block of activation rows is multiplied by each group,
// then the products are scaled and summed; so no tile load waits on the stores just before
// it, and no read of a product waits on the tile store just before it.
template <class L>
__attribute__((target("amx-tile,amx-bf16"))) void tile_amx(
    const uint8_t* tile, int64_t groups, const pagedllm::bf16* x, int64_t k, int64_t rows,
    const float* xsum, float* total, AmxScratch& s, pagedllm::bf16* out, int64_t ldo) {
  std::memset(total, 0, sizeof(float) * rows * kTile);
  __m512 d[kAmxGroups], m_shifted[kAmxGroups];
  for (int64_t g0 = 0; g0 < groups; g0 += kAmxGroups) {
    const int count = static_cast<int>(std::min<int64_t>(kAmxGroups, groups - g0));
    for (int i = 0; i < count; ++i) {
      const int64_t g = g0 + i;
      const uint8_t* block = group_codes<L>(tile, g);
      prefetch_group<L>(tile, g);
      uint8_t* b = s.b[i];
      for (int j = 0; j < 4; ++j) {
        const __m512i v = _mm512_loadu_si512(block + 64 * j);
        _mm512_store_si512(b + 64 * (4 * j + 0), (__m512i)codes_pair<0>(v));
        _mm512_store_si512(b + 64 * (4 * j + 1), (__m512i)codes_pair<1>(v));
        _mm512_store_si512(b + 64 * (4 * j + 2), (__m512i)codes_pair<2>(v));
        _mm512_store_si512(b + 64 * (4 * j + 3), (__m512i)codes_pair<3>(v));
      }
      __m512 m;
      group_scales<L>(tile, g, d[i], m);
      m_shifted[i] = _mm512_fnmadd_ps(d[i], _mm512_set1_ps(128.0f), m);  // m - 128 d
    }
    for (int64_t r0 = 0; r0 < rows; r0 += kAmxRows) {
      const int64_t block_rows = std::min<int64_t>(kAmxRows, rows - r0);
      const bool last = block_rows < kAmxRows;
      for (int i = 0; i < count; ++i)
        group_product(i, last, s.b[i], x + r0 * k + (g0 + i) * kGroup, k, s.c[i]);
      for (int64_t r = 0; r < block_rows; ++r) {
        float* t = total + (r0 + r) * kTile;
        __m512 sum = _mm512_loadu_ps(t);
        for (int i = 0; i < count; ++i) {
          sum = _mm512_fmadd_ps(_mm512_load_ps(s.c[i] + r * kTile), d[i], sum);
          sum = _mm512_fmadd_ps(m_shifted[i], _mm512_set1_ps(xsum[(r0 + r) * groups + g0 + i]), sum);
        }
        _mm512_storeu_ps(t, sum);
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * ldo),
                        (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(total + r * kTile)));
}

// x [rows, k] @ every tile of the packed weight -> out [rows, n], threads taking tiles from a
// shared counter (as for_each_tile hands them out). Each thread loads the tile configuration
// (it is per thread) and releases the tiles when done.
template <class L>
__attribute__((target("amx-tile,amx-bf16"))) void amx_exact_gemm(
    const uint8_t* packed, int64_t tile_bytes, int64_t tiles, const pagedllm::bf16* x, int64_t k,
    int64_t rows, const float* xsum, pagedllm::bf16* out, int64_t n) {
  const int64_t groups = k / kGroup;
  const int64_t threads = pagedllm::num_threads();
  const int64_t chunk = std::max<int64_t>(1, tiles / (threads * 16));
  std::atomic<int64_t> next{0};
  pagedllm::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    configure_tiles(static_cast<int>(rows % kAmxRows));
    const auto scratch = std::make_unique<AmxScratch>();
    const auto total = pagedllm::scratch<float>(rows * kTile);
    for (int64_t begin = next.fetch_add(chunk); begin < tiles; begin = next.fetch_add(chunk))
      for (int64_t t = begin; t < std::min(tiles, begin + chunk); ++t)
        tile_amx<L>(packed + t * tile_bytes, groups, x, k, rows, xsum, total.get(), *scratch,
                    out + t * kTile, n);
    pagedllm::amx::release_tiles();
  });
}

// Group g's 16 B rows, w = d * q + m rounded to bfloat16: row 4j + P holds inputs
// 8j + 2P (low half of each lane) and 8j + 2P + 1 (high half) of the 16 output rows.
template <class L>
inline void dequantized_b_tile(const uint8_t* tile, int64_t g, uint8_t* b) {
  const uint8_t* block = group_codes<L>(tile, g);
  __m512 d, m;
  group_scales<L>(tile, g, d, m);
  const __m512i nibble = _mm512_set1_epi32(0xF);
  for (int j = 0; j < 4; ++j) {
    const __m512i v = _mm512_loadu_si512(block + 64 * j);
    for (int p = 0; p < 4; ++p) {
      const __m512i q0 = _mm512_and_si512(_mm512_srli_epi32(v, 4 * p), nibble);
      const __m512i q1 = _mm512_and_si512(_mm512_srli_epi32(v, 16 + 4 * p), nibble);
      const __m512i w0 = pagedllm::amx::round_to_bf16_high(_mm512_fmadd_ps(d, _mm512_cvtepi32_ps(q0), m));
      const __m512i w1 = pagedllm::amx::round_to_bf16_high(_mm512_fmadd_ps(d, _mm512_cvtepi32_ps(q1), m));
      _mm512_store_si512(b + 64 * (4 * j + p), _mm512_or_si512(_mm512_srli_epi32(w0, 16), w1));
    }
  }
}

template <class L>
void amx_q4_bf16_gemm(const uint8_t* packed, int64_t tile_bytes, int64_t tiles, const pagedllm::bf16* x,
                      int64_t k, int64_t rows, pagedllm::bf16* out, int64_t n) {
  pagedllm::amx::bf16_gemm(tiles, k / kGroup, x, k, rows, out, n, [&](int64_t t, int64_t g, uint8_t* b) {
    const uint8_t* tile = packed + t * tile_bytes;
    prefetch_group<L>(tile, g);
    dequantized_b_tile<L>(tile, g, b);
  });
}

}  // namespace pagedllm::q4

#endif  // PAGEDLLM_AMX_TILES
