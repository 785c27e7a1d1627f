// The AMX tiles' basics shared by the low-bit kernels of the avx512 build: the tile
// configuration, and the many-row product with each weight rounded to bfloat16 once, over any
// packed format that can write its groups as B tiles (q4_tiles_amx.h: Q4_0/Q4_1/Q4_K;
// q6_gemm.cpp: Q6_K). Callers check amx_tiles_usable() (q4_gemm.cpp) first.
#pragma once
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>

#include "plain.h"

#if defined(__AVX512BF16__) && defined(__x86_64__)
#include <immintrin.h>
#define PAGEDLLM_AMX_TILES 1

namespace pagedllm::amx {

constexpr int kAmxRows = 16;  // activation rows per A tile

// The palette-1 tile configuration (64 bytes, as LDTILECFG reads it).
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

__attribute__((target("amx-tile"))) inline void release_tiles() { _tile_release(); }

// GCC 12's _tile_loadconfig tells the compiler it reads 8 bytes of the config, so without a
// barrier the stores of the sizes are dropped as dead (and the tiles stay unconfigured: SIGILL
// at the first tile load).
__attribute__((target("amx-tile"))) inline void load_config(const TileConfig& config) {
  asm volatile("" : : "r"(&config) : "memory");
  _tile_loadconfig(&config);
}

// The many-row product (a prefill chunk of 128 rows or more) with each weight rounded to
// bfloat16 once, as dequantizing the weight for oneDNN rounds it (q4_dequant.cpp), but
// fused: per tile of 16 output rows, its groups' B tiles are written into a buffer of the
// calling thread (64 KB for 2048 inputs: L2) and multiplied by blocks
// of up to 64 activation rows, each block's 4 C tiles accumulating over every group and read
// once at the end. No dense copy of the weight goes through memory (dequantize + oneDNN wrote
// and read 2 bytes a weight each step), and no per-group read-out is needed, since the
// scales are inside the rounded weights.
constexpr int kAmxPassRows = 64;  // 4 C tiles of 16 rows

// Tiles for one pass of `rows` (1..64) activation rows: C 0-3 (16 rows each, the last block
// shorter), A 4 (16 rows) and 5 (the last block's rows), B 6 and 7 (alternating groups).
__attribute__((target("amx-tile"))) inline void configure_pass(int rows) {
  TileConfig config;
  for (int t = 0; t < 8; ++t) config.colsb[t] = 64;
  const int blocks = (rows + kAmxRows - 1) / kAmxRows, last = rows - (blocks - 1) * kAmxRows;
  for (int b = 0; b < 4; ++b) config.rows[b] = b < blocks - 1 ? kAmxRows : (b == blocks - 1 ? last : 1);
  config.rows[4] = kAmxRows;
  config.rows[5] = static_cast<uint8_t>(last);
  config.rows[6] = config.rows[7] = kAmxRows;
  load_config(config);
}

// Round 16 float32 lanes to bfloat16, nearest even (as bf16(float) and q4_dequant.cpp do),
// returned in the high 16 bits of each lane.
inline __m512i round_to_bf16_high(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
  return _mm512_and_si512(r, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u)));
}

// C tile `c` += one block of activation rows (A tile 4, or 5 for the shorter last block) x the
// B tile `b_tile` (6 or 7). GCC's tile intrinsics take the tile numbers as literal tokens
// (they are pasted into the instruction's text), hence the switch.
#define PAGEDLLM_ACCUMULATE(C)                      \
  if (last) _tile_loadd(5, x, k * 2);               \
  else _tile_loadd(4, x, k * 2);                    \
  if (last && b_tile == 6) _tile_dpbf16ps(C, 5, 6); \
  else if (last) _tile_dpbf16ps(C, 5, 7);           \
  else if (b_tile == 6) _tile_dpbf16ps(C, 4, 6);    \
  else _tile_dpbf16ps(C, 4, 7);

__attribute__((target("amx-tile,amx-bf16"))) inline void accumulate_block(
    int c, bool last, int b_tile, const pagedllm::bf16* x, int64_t k) {
  switch (c) {
    case 0: { PAGEDLLM_ACCUMULATE(0) break; }
    case 1: { PAGEDLLM_ACCUMULATE(1) break; }
    case 2: { PAGEDLLM_ACCUMULATE(2) break; }
    default: { PAGEDLLM_ACCUMULATE(3) break; }
  }
}
#undef PAGEDLLM_ACCUMULATE

__attribute__((target("amx-tile"))) inline void store_block(int blk, float* c) {
  switch (blk) {
    case 0: _tile_stored(0, c, 64); break;
    case 1: _tile_stored(1, c, 64); break;
    case 2: _tile_stored(2, c, 64); break;
    default: _tile_stored(3, c, 64); break;
  }
}

// x [rows, k] @ a packed low-bit weight of `tiles` tiles of 16 output rows and `groups` groups
// of 32 inputs -> out [rows, n] bfloat16. make_b(t, g, b) writes tile t's group g as a B tile
// (16 rows of 64 bytes: row p, inputs 2p and 2p + 1 of the 16 output rows, bfloat16 pairs).
template <class MakeB>
__attribute__((target("amx-tile,amx-bf16"))) void bf16_gemm_sweep(
    int64_t tiles, int64_t groups, const pagedllm::bf16* x, int64_t k, int64_t rows,
    pagedllm::bf16* out, int64_t n, const MakeB& make_b) {
  const int64_t threads = pagedllm::num_threads();
  const int64_t chunk = std::max<int64_t>(1, tiles / (threads * 8));
  std::atomic<int64_t> next{0};
  pagedllm::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    // The B tiles of one tile of output rows, every group (64-byte aligned).
    const auto storage = pagedllm::scratch<uint8_t>(groups * 1024 + 64);
    uint8_t* b = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(storage.get()) + 63) & ~uintptr_t{63});
    alignas(64) float c[kAmxRows * 16];
    int configured = -1;
    for (int64_t begin = next.fetch_add(chunk); begin < tiles; begin = next.fetch_add(chunk))
      for (int64_t t = begin; t < std::min(tiles, begin + chunk); ++t) {
        for (int64_t g = 0; g < groups; ++g) make_b(t, g, b + g * 1024);
        for (int64_t r0 = 0; r0 < rows; r0 += kAmxPassRows) {
          const int pass = static_cast<int>(std::min<int64_t>(kAmxPassRows, rows - r0));
          if (pass != configured) configure_pass(configured = pass);
          const int blocks = (pass + kAmxRows - 1) / kAmxRows;
          const bool short_last = pass % kAmxRows != 0;
          _tile_zero(0);
          _tile_zero(1);
          _tile_zero(2);
          _tile_zero(3);
          for (int64_t g = 0; g < groups; ++g) {
            const int b_tile = g % 2 == 0 ? 6 : 7;
            if (b_tile == 6) _tile_loadd(6, b + g * 1024, 64);
            else _tile_loadd(7, b + g * 1024, 64);
            const pagedllm::bf16* xg = x + r0 * k + g * 32;
            const auto last = [&](int blk) { return short_last && blk == blocks - 1; };
            for (int blk = 0; blk < blocks; ++blk)
              accumulate_block(blk, last(blk), b_tile, xg + blk * kAmxRows * k, k);
          }
          for (int blk = 0; blk < blocks; ++blk) {
            store_block(blk, c);
            const int64_t count = std::min<int64_t>(kAmxRows, pass - blk * kAmxRows);
            for (int64_t r = 0; r < count; ++r)
              _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + (r0 + blk * kAmxRows + r) * n + t * 16),
                                  (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(c + r * 16)));
          }
        }
      }
    release_tiles();
  });
}

// The activation rows a sweep of the output tiles reads, in bytes: every output tile reads all
// of a sweep's rows, so they should stay in L2 (2 MB a core on Sapphire Rapids) beside the
// tile's B buffer; more rows are taken in several sweeps, each writing its B tiles again
// (1 MiB: 256 rows over 2048 inputs, 64 over 8192; against one sweep of everything, 480-512
// rows of SmolLM2-1.7B's 16384 x 2048 took ~0.8x the time, 2048 x 8192 ~0.85x, and 512 KiB
// or 2 MiB sweeps did no better: BENCHMARKS.md, "Prefill attention on the tiles").
constexpr int64_t kSweepBytes = 1 << 20;

template <typename MakeB>
void bf16_gemm(int64_t tiles, int64_t groups, const pagedllm::bf16* x, int64_t k, int64_t rows,
               pagedllm::bf16* out, int64_t n, const MakeB& make_b) {
  const int64_t sweep = std::max<int64_t>(kAmxPassRows, kSweepBytes / (2 * k) / kAmxPassRows * kAmxPassRows);
  for (int64_t r0 = 0; r0 < rows; r0 += sweep)
    bf16_gemm_sweep(tiles, groups, x + r0 * k, k, std::min(sweep, rows - r0), out + r0 * n, n, make_b);
}

}  // namespace pagedllm::amx

#endif  // __AVX512BF16__ && __x86_64__
