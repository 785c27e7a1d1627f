// What the kernels need from outside plain C++, without torch's headers: the two 16-bit
// float types by their bits, the element-type tag, and a parallel loop over OpenMP that
// splits work as torch's at::parallel_for does. Parsing torch's headers cost ~20 s per
// translation unit, most of a level's build; only bindings.cpp includes them now, and the
// kernel units (kernels.h) compile in seconds. pagedllm.kernels hashes this header into the
// build's name, since torch's extension builder only watches the .cpp sources.
#pragma once
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>

#if defined(__F16C__)
#include <immintrin.h>
#endif

namespace pagedllm {

// The element types of activations and float caches.
enum class DType { Float32, BFloat16 };

// A bfloat16 by its bits. From float: rounded to nearest even, NaN kept a (quiet) NaN, as
// torch's conversion does; to float: exact.
struct bf16 {
  uint16_t bits;
  bf16() = default;
  explicit bf16(float v) {
    uint32_t u;
    std::memcpy(&u, &v, 4);
    // Tested by its bits: the kernels build with -ffast-math, which assumes no NaN.
    bits = (u & 0x7FFFFFFFu) > 0x7F800000u ? uint16_t{0x7FC0}
                                            : static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
  }
  operator float() const {
    const uint32_t u = static_cast<uint32_t>(bits) << 16;
    float v;
    std::memcpy(&v, &u, 4);
    return v;
  }
};
static_assert(sizeof(bf16) == 2, "bf16 is its 16 bits");

// An IEEE float16 by its bits (GGUF's scales), read as float32 exactly.
struct f16 {
  uint16_t bits;
  operator float() const {
#if defined(__F16C__)
    return _cvtsh_ss(bits);
#else
    const uint32_t sign = static_cast<uint32_t>(bits & 0x8000u) << 16;
    uint32_t exponent = (bits >> 10) & 0x1Fu, mantissa = bits & 0x3FFu, u;
    if (exponent == 0x1F) {
      u = sign | 0x7F800000u | (mantissa << 13);  // infinity, NaN
    } else if (exponent != 0) {
      u = sign | ((exponent + 112) << 23) | (mantissa << 13);
    } else if (mantissa == 0) {
      u = sign;  // zero
    } else {  // subnormal: normalise it
      exponent = 113;
      while (!(mantissa & 0x400u)) mantissa <<= 1, --exponent;
      u = sign | (exponent << 23) | ((mantissa & 0x3FFu) << 13);
    }
    float v;
    std::memcpy(&v, &u, 4);
    return v;
#endif
  }
};
static_assert(sizeof(f16) == 2, "f16 is its 16 bits");

// A scratch array of n values left uninitialised (each is written before it is read).
template <typename T>
std::unique_ptr<T[]> scratch(int64_t n) {
  return std::unique_ptr<T[]>(new T[static_cast<size_t>(n)]);
}

// torch's intra-op thread count (torch.set_num_threads), defined in bindings.cpp.
int num_threads();

// f(begin, end) over [begin, end) split into one contiguous chunk per thread, no chunk
// smaller than `grain`; inline when the range is that small or when already inside a
// parallel region. The same split as torch's at::parallel_for on its OpenMP backend.
template <typename F>
void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  if (begin >= end) return;
  const int64_t count = end - begin;
  const int64_t threads = std::min<int64_t>(num_threads(), grain > 0 ? (count + grain - 1) / grain : count);
  if (threads <= 1 || count <= grain || omp_in_parallel()) {
    f(begin, end);
    return;
  }
  const int64_t chunk = (count + threads - 1) / threads;
#pragma omp parallel num_threads(static_cast<int>(threads))
  {
    const int64_t first = begin + omp_get_thread_num() * chunk;
    if (first < end) f(first, std::min(end, first + chunk));
  }
}

}  // namespace pagedllm
