// This host's own peaks, measured with the instruction mix the kernels use, so that a
// benchmark can print each kernel's and each step's share of what the core and the memory
// can do (benchmarks/roof.py). Each runs on every kernel thread at once (the shares are of
// the whole machine, as the kernels run):
// - roof_int8: int8 multiply-adds in registers. avx2: vpmaddubsw and a 16-bit add (the
//   4-bit tiles' pair, q4_tiles_avx2.h); avx512: vpdpbusd; portable: plain C++ the
//   compiler vectorises for its baseline.
// - roof_fma: float32 FMAs in registers (the exact tiles' arithmetic at avx2).
// - roof_read: bytes read from a buffer larger than the caches (the decode floor).
// Independent chains (more than latency x issue width) keep every pipe busy.
#include <atomic>

#include "kernels.h"
#include "lowbit_gemm.h"

namespace pagedllm::kernel {

namespace {

constexpr int kChains = 12;

// The chains' values, kept so the compiler cannot drop the work.
std::atomic<int64_t> sink{0};

}  // namespace

double roof_int8(int64_t iterations) {
  const int64_t threads = num_threads();
  parallel_for(0, threads, 1, [&](int64_t, int64_t) {
#if defined(__AVX512VNNI__)
    __m512i acc[kChains];
    const __m512i a = _mm512_set1_epi8(3), b = _mm512_set1_epi8(-2);
    for (auto& v : acc) v = _mm512_setzero_si512();
    for (int64_t i = 0; i < iterations; ++i)
      for (auto& v : acc) {
        v = _mm512_dpbusd_epi32(v, a, b);
        asm volatile("" : "+v"(v));
      }
    int64_t total = 0;
    for (auto& v : acc) total += _mm512_reduce_add_epi32(v);
#elif defined(__AVX2__)
    __m256i acc[kChains];
    // The chain's own value is the unsigned operand, so no product can be computed once for
    // all: each step is a dependent vpmaddubsw + vpaddw, 12 chains deep.
    const __m256i b = _mm256_set1_epi8(-2);
    for (int c = 0; c < kChains; ++c) acc[c] = _mm256_set1_epi8(static_cast<char>(c + 1));
    for (int64_t i = 0; i < iterations; ++i)
      for (auto& v : acc) {
        v = _mm256_add_epi16(v, _mm256_maddubs_epi16(v, b));
        asm volatile("" : "+x"(v));
      }
    int64_t total = 0;
    for (auto& v : acc) total += _mm256_extract_epi16(v, 0);
#else
    alignas(64) int32_t acc[kChains][16] = {};
    alignas(64) int8_t a[64], b[64];
    for (int i = 0; i < 64; ++i) a[i] = static_cast<int8_t>(i & 7), b[i] = static_cast<int8_t>(-(i & 3));
    for (int64_t i = 0; i < iterations; ++i) {
      for (int c = 0; c < kChains; ++c)
        for (int l = 0; l < 16; ++l)
          acc[c][l] += a[4 * l] * b[4 * l] + a[4 * l + 1] * b[4 * l + 1] + a[4 * l + 2] * b[4 * l + 2] +
                       a[4 * l + 3] * b[4 * l + 3];
      asm volatile("" : : "r"(&acc[0][0]) : "memory");
    }
    int64_t total = acc[0][0];
#endif
    sink += total;
  });
  // Multiply-adds done: per chain step, 64 (vpdpbusd), 32 (vpmaddubsw) or 64 (portable).
#if defined(__AVX512VNNI__) || !defined(__AVX2__)
  constexpr double kPerStep = 64;
#else
  constexpr double kPerStep = 32;
#endif
  return kPerStep * kChains * static_cast<double>(iterations) * static_cast<double>(threads);
}

double roof_fma(int64_t iterations) {
  const int64_t threads = num_threads();
  parallel_for(0, threads, 1, [&](int64_t, int64_t) {
#if defined(__AVX512F__)
    __m512 acc[kChains];
    const __m512 a = _mm512_set1_ps(0.999f), b = _mm512_set1_ps(1e-3f);
    for (auto& v : acc) v = _mm512_setzero_ps();
    for (int64_t i = 0; i < iterations; ++i)
      for (auto& v : acc) {
        v = _mm512_fmadd_ps(v, a, b);
        asm volatile("" : "+v"(v));
      }
    float total = 0;
    for (auto& v : acc) total += _mm512_reduce_add_ps(v);
#elif defined(__AVX2__) && defined(__FMA__)
    __m256 acc[kChains];
    const __m256 a = _mm256_set1_ps(0.999f), b = _mm256_set1_ps(1e-3f);
    for (auto& v : acc) v = _mm256_setzero_ps();
    for (int64_t i = 0; i < iterations; ++i)
      for (auto& v : acc) {
        v = _mm256_fmadd_ps(v, a, b);
        asm volatile("" : "+x"(v));
      }
    float total = _mm256_cvtss_f32(acc[0]);
#else
    alignas(64) float acc[kChains][16] = {};
    for (int64_t i = 0; i < iterations; ++i) {
      for (int c = 0; c < kChains; ++c)
        for (int l = 0; l < 16; ++l) acc[c][l] = acc[c][l] * 0.999f + 1e-3f;
      asm volatile("" : : "r"(&acc[0][0]) : "memory");
    }
    float total = acc[0][0];
#endif
    sink += static_cast<int64_t>(total);
  });
#if defined(__AVX512F__) || !(defined(__AVX2__) && defined(__FMA__))
  constexpr double kPerStep = 16;
#else
  constexpr double kPerStep = 8;
#endif
  return kPerStep * kChains * static_cast<double>(iterations) * static_cast<double>(threads);
}

int64_t roof_read(const uint8_t* data, int64_t bytes) {
  // Each thread sums its own stretch, 64 bytes a step in 4 chains (the kernels' loads).
  std::atomic<int64_t> total{0};
  parallel_for(0, bytes / 256, 1 << 12, [&](int64_t begin, int64_t end) {
    uint64_t lanes[4] = {};
    for (int64_t i = begin; i < end; ++i)
      for (int c = 0; c < 4; ++c) {
        uint64_t word[8];
        std::memcpy(word, data + 256 * i + 64 * c, 64);
        for (uint64_t w : word) lanes[c] ^= w;
      }
    total += static_cast<int64_t>(lanes[0] ^ lanes[1] ^ lanes[2] ^ lanes[3]);
  });
  return total;
}

}  // namespace pagedllm::kernel
