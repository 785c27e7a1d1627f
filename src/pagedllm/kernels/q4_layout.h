// The packed layout of 4-bit weights shared by q4_gemm.cpp and the tiles of each CPU level.
#pragma once
#include "lowbit_gemm.h"

namespace pagedllm::q4 {

using namespace pagedllm::lowbit;


constexpr int64_t kCodeBytes = kTile * kGroup / 2;           // 256: 4 bits a code
constexpr int64_t kBlockBytes = kCodeBytes + 2 * kTile * 2;  // codes, then d and m (float16)

// Bit position, within lane i's 32 bits of code vector j, of the code of input 8j + c:
// a pair of inputs (2p, 2p + 1) sits at bits 4p and 16 + 4p, so (lane >> 4p) & 0x000F000F
// leaves exactly the pair as two 16-bit integers.
inline int code_shift(int c) { return (c % 2) * 16 + (c / 2) * 4; }

}  // namespace pagedllm::q4
