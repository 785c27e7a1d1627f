// A packed 4-bit weight (q4_layout.h: Q4_0/Q4_1 groups, or Q4_K super-blocks) written out as
// a dense bfloat16 matrix, transposed ([K, N]: the packing's order, 16 rows an input): for the steps with many rows, which then run on the CPU's
// bfloat16 matrix units through oneDNN (AMX tiles where the CPU has them: models/amx.py)
// instead of pagedllm's own 4-bit tiles. Each weight is d * q + m (d * sc * q + dmin * mn
// for Q4_K) in float32, rounded once to bfloat16.
#include <cstdint>
#include <cstring>

#include "kernels.h"
#include "q4_layout.h"

namespace {

using namespace pagedllm::q4;
using pagedllm::bf16;
using pagedllm::f16;
using pagedllm::parallel_for;

inline float half_at(const uint8_t* p) {
  f16 h;
  std::memcpy(&h.bits, p, 2);
  return static_cast<float>(h);
}

template <class L>
void dequantize_tiles(const uint8_t* packed, int64_t n, int64_t k, bf16* out) {
  const int64_t groups = k / kGroup, tiles = n / kTile;
  const int64_t tile_bytes = groups / L::kGroupsPerBlock * L::kBlockBytes;
  // Groups (inputs) outside, tiles (rows) inside: each output row [K, N] is written along.
  parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      for (int64_t t = 0; t < tiles; ++t) {
        const uint8_t* tile = packed + t * tile_bytes;
        const uint8_t* codes = group_codes<L>(tile, g);
        float scale[kTile], low[kTile];
        if constexpr (L::kGroupsPerBlock == 1) {
          for (int64_t i = 0; i < kTile; ++i) {
            scale[i] = half_at(codes + kCodeBytes + 2 * i);
            low[i] = half_at(codes + kCodeBytes + 2 * kTile + 2 * i);
          }
        } else {
          const uint8_t* block = tile + g / L::kGroupsPerBlock * L::kBlockBytes;
          const int64_t j = g % L::kGroupsPerBlock;
          for (int64_t i = 0; i < kTile; ++i) {
            scale[i] = half_at(block + L::kDOffset + 2 * i) * block[L::kScaleOffset + kTile * j + i];
            low[i] = half_at(block + L::kDminOffset + 2 * i) * block[L::kMinOffset + kTile * j + i];
          }
        }
        // Written transposed, [K, N]: an input's 16 rows are one vector of 16 lanes (the
        // codes of vector j hold them side by side), stored in one go.
        for (int j = 0; j < 4; ++j) {
          uint32_t lanes[kTile];
          std::memcpy(lanes, codes + 64 * j, sizeof(lanes));
          for (int c = 0; c < 8; ++c) {
            const int shift = code_shift(c);
            uint16_t* col = reinterpret_cast<uint16_t*>(out + (g * kGroup + 8 * j + c) * n + t * kTile);
            for (int64_t i = 0; i < kTile; ++i) {
              const float v = scale[i] * static_cast<float>((lanes[i] >> shift) & 0xFu) + low[i];
              uint32_t u;
              std::memcpy(&u, &v, 4);
              col[i] = static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);  // to nearest even
            }
          }
        }
      }
    }
  });
}


// Q8_0's packed tiles (q8_gemm.cpp's q8_pack): per tile of 16 rows and group of 32 inputs,
// code c of row i at byte 64 * (c / 4) + 4 * i + c % 4 (stored + 128), then 16 float16 d.
void dequantize_q8_tiles(const uint8_t* packed, int64_t n, int64_t k, bf16* out) {
  constexpr int64_t kQ8CodeBytes = kTile * kGroup;
  const int64_t groups = k / kGroup, tiles = n / kTile;
  parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      for (int64_t t = 0; t < tiles; ++t) {
        const uint8_t* block = packed + (t * groups + g) * pagedllm::kernel::kQ8PackedBlockBytes;
        float d[kTile];
        for (int64_t i = 0; i < kTile; ++i) d[i] = half_at(block + kQ8CodeBytes + 2 * i);
        for (int64_t c = 0; c < kGroup; ++c) {
          bf16* column = out + (g * kGroup + c) * n + t * kTile;
          const uint8_t* codes = block + 64 * (c / 4) + c % 4;
          for (int64_t i = 0; i < kTile; ++i)
            column[i] = bf16(d[i] * static_cast<float>(static_cast<int>(codes[4 * i]) - 128));
        }
      }
    }
  });
}

}  // namespace

namespace pagedllm::kernel {

void q8_dequantize(const uint8_t* packed, int64_t n, int64_t k, bf16* out) {
  dequantize_q8_tiles(packed, n, k, out);
}

void q4_dequantize(const uint8_t* packed, bool super, int64_t n, int64_t k, bf16* out) {
  if (super) dequantize_tiles<SuperLayout>(packed, n, k, out);
  else dequantize_tiles<GroupLayout>(packed, n, k, out);
}

}  // namespace pagedllm::kernel
