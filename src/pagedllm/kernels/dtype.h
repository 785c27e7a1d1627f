// float32 / bfloat16 element access and the compile-time dispatch (dtype, head shape) shared
// by the kernels in this folder. bfloat16 <-> float by bit shifts, written so the compiler
// vectorises them (c10's scalar conversion does not); stores round to nearest even. pagedllm.kernels hashes this header into the build flags,
// since torch's extension builder only watches the .cpp sources.
#pragma once
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "plain.h"

namespace pagedllm {

template <typename T> struct Cvt;

template <> struct Cvt<float> {
  static inline float load(const float* p, int64_t i) { return p[i]; }
  static inline void store(float* p, int64_t i, float v) { p[i] = v; }
  static inline float round(float v) { return v; }
};

template <> struct Cvt<bf16> {
  static inline float load(const bf16* p, int64_t i) {
    uint32_t bits = static_cast<uint32_t>(reinterpret_cast<const uint16_t*>(p)[i]) << 16;
    float v;
    std::memcpy(&v, &bits, 4);
    return v;
  }
  static inline uint16_t to_bits(float v) {
    uint32_t u;
    std::memcpy(&u, &v, 4);
    u += 0x7FFFu + ((u >> 16) & 1u);  // round to nearest even
    return static_cast<uint16_t>(u >> 16);
  }
  static inline void store(bf16* p, int64_t i, float v) {
    reinterpret_cast<uint16_t*>(p)[i] = to_bits(v);
  }
  static inline float round(float v) {
    uint32_t bits = static_cast<uint32_t>(to_bits(v)) << 16;
    float r;
    std::memcpy(&r, &bits, 4);
    return r;
  }
};

// Calls fn with a value of the C++ type for float32 or bfloat16 (callers checked it is one).
template <typename Fn>
void dispatch(DType type, Fn fn) {
  if (type == DType::BFloat16) fn(bf16{});
  else fn(float{});
}

// The head sizes the attention kernels are built for (Llama/Qwen 128, SmolLM 64, Phi-2 80,
// Phi-3-small 96, Gemma 256), and the most query heads one task holds.
inline bool supported_head_dim(int64_t d) { return d == 64 || d == 80 || d == 96 || d == 128 || d == 256; }
constexpr int64_t kMaxTaskGroup = 8;

// The query heads of a KV head that one attention task takes together: the whole group up
// to 8; a larger group (16 query heads on 1 KV head, say) is split into equal parts, the
// largest that divides it, each part a task that reads the same keys.
inline int64_t task_group(int64_t group) {
  for (int64_t g = std::min(group, kMaxTaskGroup); g > 1; --g)
    if (group % g == 0) return g;
  return 1;
}

// Calls fn(integral_constant D, integral_constant G) for head_dim D (supported_head_dim) and
// G = task_group(query heads per KV head), which the attention kernels take as template
// constants so that their loops unroll; callers have checked the head size.
template <int G = 1, typename Fn>
void dispatch_group(int64_t group, const Fn& fn) {
  if constexpr (G <= kMaxTaskGroup) {
    if (group == G) fn(std::integral_constant<int, G>{});
    else dispatch_group<G + 1>(group, fn);
  }
}

template <typename Fn>
void dispatch_head_shape(int64_t head_dim, int64_t group, const Fn& fn) {
  const auto with_dim = [&](auto dim) { dispatch_group(task_group(group), [&](auto g) { fn(dim, g); }); };
  switch (head_dim) {
    case 64: with_dim(std::integral_constant<int, 64>{}); break;
    case 80: with_dim(std::integral_constant<int, 80>{}); break;
    case 96: with_dim(std::integral_constant<int, 96>{}); break;
    case 128: with_dim(std::integral_constant<int, 128>{}); break;
    default: with_dim(std::integral_constant<int, 256>{}); break;
  }
}

}  // namespace pagedllm
