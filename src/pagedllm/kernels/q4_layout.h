// The packed layouts of 4-bit weights shared by q4_gemm.cpp and the tiles of each CPU level.
// Both hold, per tile of 16 output rows and group of 32 inputs, four 64-byte code vectors
// (lane i: 8 codes of output row i, at code_shift's bits); they differ in where a group's
// scales come from:
// - GroupLayout (Q4_0, Q4_1): each group's codes are followed by its 16 d and 16 m as
//   float16: w = d * q + m.
// - SuperLayout (Q4_K): 8 groups (256 inputs) share a block: their codes, then per group the
//   16 rows' 6-bit scale and min as bytes, then per row d and dmin (float16, dmin stored
//   negated): w = (d * sc) * q + (dmin * mn), as the GGUF file holds it, at 4.625 bits a
//   weight instead of GroupLayout's 5. d * sc is exact in float32.
// A packed weight is [N / 16, blocks, block bytes]; its last size tells the layout.
#pragma once
#include "lowbit_gemm.h"

namespace pagedllm::q4 {

using namespace pagedllm::lowbit;


constexpr int64_t kCodeBytes = kTile * kGroup / 2;  // 256: 4 bits a code

struct GroupLayout {
  static constexpr int64_t kGroupsPerBlock = 1;
  static constexpr int64_t kBlockBytes = kCodeBytes + 2 * kTile * 2;  // codes, d, m: 320
};

struct SuperLayout {
  static constexpr int64_t kGroupsPerBlock = 8;
  static constexpr int64_t kScaleOffset = kGroupsPerBlock * kCodeBytes;           // sc [8][16]
  static constexpr int64_t kMinOffset = kScaleOffset + kGroupsPerBlock * kTile;   // mn [8][16]
  static constexpr int64_t kDOffset = kMinOffset + kGroupsPerBlock * kTile;       // d [16]
  static constexpr int64_t kDminOffset = kDOffset + 2 * kTile;                    // -dmin [16]
  static constexpr int64_t kBlockBytes = kDminOffset + 2 * kTile;                 // 2368
};

// Where group g's codes start in a tile's bytes.
template <class L>
inline const uint8_t* group_codes(const uint8_t* tile, int64_t g) {
  return tile + g / L::kGroupsPerBlock * L::kBlockBytes + g % L::kGroupsPerBlock * kCodeBytes;
}

// The codes a tile reads ~16 groups ahead, asked for while group g is multiplied (the
// hardware prefetcher alone left the kernels waiting on memory).
template <class L>
inline void prefetch_group(const uint8_t* tile, int64_t g) {
  constexpr int64_t kGroupBytes = L::kBlockBytes / L::kGroupsPerBlock;
  prefetch_ahead(tile + g * kGroupBytes, kGroupBytes);
}

// Bit position, within lane i's 32 bits of code vector j, of the code of input 8j + c:
// a pair of inputs (2p, 2p + 1) sits at bits 4p and 16 + 4p, so (lane >> 4p) & 0x000F000F
// leaves exactly the pair as two 16-bit integers.
inline int code_shift(int c) { return (c % 2) * 16 + (c / 2) * 4; }

}  // namespace pagedllm::q4
