// This host's own peaks, measured with the instruction mix the kernels use, so that a
// benchmark can print each kernel's and each step's share of what the core and the memory
// can do (benchmarks/roof.py). Each runs on every kernel thread at once (the shares are of
// the whole machine, as the kernels run):
// - roof_int8: int8 multiply-adds in registers. avx2: vpmaddubsw and a 16-bit add (the
//   4-bit tiles' pair, q4_tiles_avx2.h); avx512: vpdpbusd; portable: plain C++ the
//   compiler vectorises for its baseline.
// - roof_fma: float32 FMAs in registers (the exact tiles' arithmetic at avx2).
// - roof_read: bytes read from a buffer larger than the caches (the decode floor), asked for
//   ahead as the kernels ask for their codes (lowbit::prefetch_ahead): without it, on an
//   Intel Xeon, one core's read came ~20 % under a plain torch sum and under what the
//   kernels themselves read (docs/benchmarks/log.md, twenty-third session).
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

// One step of the int8 roof: six independent products, each added to its own chain, as the
// tiles add theirs (the products do not depend on the chains). The operands are made opaque
// to the compiler at every step, so no product is hoisted or shared, and the chains are named
// variables: in an array with a barrier on each, GCC kept them in memory (a load and a store
// around every multiply-add), which understated the peak (docs/benchmarks/log.md, "The roof
// corrected").
#define PAGEDLLM_ROOF_INT8_STEP(op)                                                           \
  do {                                                                                        \
    asm volatile("" : "+x"(w0), "+x"(w1), "+x"(w2), "+x"(x0), "+x"(x1));                      \
    op(a0, w0, x0); op(a1, w1, x0); op(a2, w2, x0); op(a3, w0, x1); op(a4, w1, x1); op(a5, w2, x1); \
  } while (0)
constexpr int kInt8Chains = 6;

double roof_int8(int64_t iterations) {
  const int64_t threads = num_threads();
  parallel_for(0, threads, 1, [&](int64_t, int64_t) {
#if defined(__AVX512VNNI__)
#define PAGEDLLM_DPBUSD(a, w, x) a = _mm512_dpbusd_epi32(a, w, x)
    __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0;
    __m512i w0 = _mm512_set1_epi8(1), w1 = _mm512_set1_epi8(2), w2 = _mm512_set1_epi8(3);
    __m512i x0 = _mm512_set1_epi8(-2), x1 = _mm512_set1_epi8(-3);
    for (int64_t i = 0; i < iterations; ++i) PAGEDLLM_ROOF_INT8_STEP(PAGEDLLM_DPBUSD);
    const int64_t total = _mm512_reduce_add_epi32(_mm512_add_epi32(
        _mm512_add_epi32(_mm512_add_epi32(a0, a1), _mm512_add_epi32(a2, a3)), _mm512_add_epi32(a4, a5)));
#elif defined(__AVX2__)
    // vpmaddubsw and a 16-bit add: the 4-bit tiles' pair (q4_tiles_avx2.h).
#define PAGEDLLM_MADDUBS(a, w, x) a = _mm256_add_epi16(a, _mm256_maddubs_epi16(w, x))
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0;
    __m256i w0 = _mm256_set1_epi8(1), w1 = _mm256_set1_epi8(2), w2 = _mm256_set1_epi8(3);
    __m256i x0 = _mm256_set1_epi8(-2), x1 = _mm256_set1_epi8(-3);
    for (int64_t i = 0; i < iterations; ++i) PAGEDLLM_ROOF_INT8_STEP(PAGEDLLM_MADDUBS);
    const __m256i s = _mm256_add_epi16(_mm256_add_epi16(_mm256_add_epi16(a0, a1), _mm256_add_epi16(a2, a3)),
                                       _mm256_add_epi16(a4, a5));
    const int64_t total = _mm256_extract_epi16(s, 0);
#else
    alignas(64) int32_t acc[kInt8Chains][16] = {};
    alignas(64) int8_t a[64], b[64];
    for (int i = 0; i < 64; ++i) a[i] = static_cast<int8_t>(i & 7), b[i] = static_cast<int8_t>(-(i & 3));
    for (int64_t i = 0; i < iterations; ++i) {
      for (int c = 0; c < kInt8Chains; ++c)
        for (int l = 0; l < 16; ++l)
          acc[c][l] += a[4 * l] * b[4 * l] + a[4 * l + 1] * b[4 * l + 1] + a[4 * l + 2] * b[4 * l + 2] +
                       a[4 * l + 3] * b[4 * l + 3];
      asm volatile("" : : "r"(&acc[0][0]) : "memory");
    }
    const int64_t total = acc[0][0];
#endif
    sink += total;
  });
  // Multiply-adds done: per chain step, 64 (vpdpbusd), 32 (vpmaddubsw) or 64 (portable).
#if defined(__AVX512VNNI__) || !defined(__AVX2__)
  constexpr double kPerStep = 64;
#else
  constexpr double kPerStep = 32;
#endif
  return kPerStep * kInt8Chains * static_cast<double>(iterations) * static_cast<double>(threads);
}
#undef PAGEDLLM_ROOF_INT8_STEP
#undef PAGEDLLM_DPBUSD
#undef PAGEDLLM_MADDUBS

double roof_fma(int64_t iterations) {
  const int64_t threads = num_threads();
  parallel_for(0, threads, 1, [&](int64_t, int64_t) {
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#if defined(__AVX512F__)
    using Vec = __m512;
    const Vec a = _mm512_set1_ps(0.999f), b = _mm512_set1_ps(1e-3f);
#define PAGEDLLM_FMA(v) v = _mm512_fmadd_ps(v, a, b)
#else
    using Vec = __m256;
    const Vec a = _mm256_set1_ps(0.999f), b = _mm256_set1_ps(1e-3f);
#define PAGEDLLM_FMA(v) v = _mm256_fmadd_ps(v, a, b)
#endif
    // Named chains behind one barrier a step, so they stay in registers (see the int8 roof).
    Vec c0 = a, c1 = a, c2 = a, c3 = a, c4 = a, c5 = a, c6 = a, c7 = a, c8 = a, c9 = a, c10 = a, c11 = a;
    for (int64_t i = 0; i < iterations; ++i) {
      PAGEDLLM_FMA(c0); PAGEDLLM_FMA(c1); PAGEDLLM_FMA(c2); PAGEDLLM_FMA(c3); PAGEDLLM_FMA(c4); PAGEDLLM_FMA(c5);
      PAGEDLLM_FMA(c6); PAGEDLLM_FMA(c7); PAGEDLLM_FMA(c8); PAGEDLLM_FMA(c9); PAGEDLLM_FMA(c10); PAGEDLLM_FMA(c11);
      asm volatile("" : "+x"(c0), "+x"(c1), "+x"(c2), "+x"(c3), "+x"(c4), "+x"(c5), "+x"(c6), "+x"(c7),
                   "+x"(c8), "+x"(c9), "+x"(c10), "+x"(c11));
    }
    float lanes[sizeof(Vec) / 4];
    std::memcpy(lanes, &c0, sizeof(lanes));
    const float total = lanes[0] + lanes[1];
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
#undef PAGEDLLM_FMA

int64_t roof_read(const uint8_t* data, int64_t bytes) {
  // Each thread sums its own stretch, 64 bytes a step in 4 chains (the kernels' loads),
  // asking for the lines kPrefetchBlocks blocks ahead into L2 as the kernels do.
  std::atomic<int64_t> total{0};
  parallel_for(0, bytes / 256, 1 << 12, [&](int64_t begin, int64_t end) {
    uint64_t lanes[4] = {};
    for (int64_t i = begin; i < end; ++i) {
      lowbit::prefetch_ahead(data + 256 * i, 256);
      for (int c = 0; c < 4; ++c) {
        uint64_t word[8];
        std::memcpy(word, data + 256 * i + 64 * c, 64);
        for (uint64_t w : word) lanes[c] ^= w;
      }
    }
    total += static_cast<int64_t>(lanes[0] ^ lanes[1] ^ lanes[2] ^ lanes[3]);
  });
  return total;
}

}  // namespace pagedllm::kernel
