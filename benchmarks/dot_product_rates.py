"""How fast this CPU issues the dot-product instructions the one-row 4-bit kernels are built
on, and how much such work per byte costs a memory stream: the evidence behind
kernels/cpu.py's choice of 16-bit integer activations (q4_i16_gemm) over bfloat16 pairs.

    .venv/bin/python benchmarks/dot_product_rates.py

Compiles a small C++ program with g++ (-march=native, OpenMP) into a temporary folder and
runs it:
- ns per instruction of vdpbf16ps, vpdpbusd, vpdpwssd and vfmadd231ps (zmm, 12 independent
  chains, so throughput, not latency); needs AVX512-BF16 and VNNI;
- 2 threads reading 400 MB with k vpdpbusd per 256 bytes read (k = 0, 16, 32), with and
  without a software prefetch into L2 16 blocks ahead: GB/s.
"""
from __future__ import annotations

import os
import subprocess
import tempfile

SOURCE = r"""
#include <immintrin.h>
#include <omp.h>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#define REP12(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11)
#define CLOBBER "zmm0","zmm1","zmm2","zmm3","zmm4","zmm5","zmm6","zmm7","zmm8","zmm9","zmm10","zmm11"
#define RATE(NAME, INSTR) {                                                         \
  const long n = 20000000;                                                          \
  auto t0 = std::chrono::steady_clock::now();                                       \
  for (long i = 0; i < n; i++) asm volatile(REP12(INSTR) ::: CLOBBER);              \
  double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(); \
  printf("%-12s %.3f ns an instruction\n", NAME, s / (n * 12.0) * 1e9); }
#define DPBF(i) "vdpbf16ps %%zmm30, %%zmm31, %%zmm" #i "\n\t"
#define DPBU(i) "vpdpbusd %%zmm30, %%zmm31, %%zmm" #i "\n\t"
#define DPWS(i) "vpdpwssd %%zmm30, %%zmm31, %%zmm" #i "\n\t"
#define FMA(i) "vfmadd231ps %%zmm30, %%zmm31, %%zmm" #i "\n\t"

double stream(const char* b, size_t n, int work, int prefetch) {
  auto t0 = std::chrono::steady_clock::now();
  long total = 0;
#pragma omp parallel reduction(+ : total)
  {
    const int t = omp_get_thread_num(), threads = omp_get_num_threads();
    const size_t per = n / threads;
    const char* p = b + t * per;
    __m512i acc = _mm512_setzero_si512(), w[8];
    for (int j = 0; j < 8; j++) w[j] = _mm512_set1_epi32(j);
    for (size_t i = 0; i + 256 <= per; i += 256) {
      if (prefetch)
        for (int l = 0; l < 256; l += 64) __builtin_prefetch(p + i + 16 * 256 + l, 0, 2);
      const __m512i v0 = _mm512_load_si512(p + i), v1 = _mm512_load_si512(p + i + 64);
      const __m512i v2 = _mm512_load_si512(p + i + 128), v3 = _mm512_load_si512(p + i + 192);
      for (int k = 0; k < work / 8; k++)
        for (int j = 0; j < 8; j++) w[j] = _mm512_dpbusd_epi32(w[j], v0, v1);
      acc = _mm512_add_epi64(acc, _mm512_add_epi64(_mm512_add_epi64(v0, v1), _mm512_add_epi64(v2, v3)));
    }
    for (int j = 0; j < 8; j++) acc = _mm512_add_epi64(acc, w[j]);
    total += _mm512_reduce_add_epi64(acc);
  }
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (total == 42) printf(" ");
  return n / s / 1e9;
}

int main() {
  asm volatile("vpxord %%zmm30, %%zmm30, %%zmm30\n\tvpxord %%zmm31, %%zmm31, %%zmm31" ::: "zmm30", "zmm31");
  RATE("vdpbf16ps", DPBF) RATE("vpdpbusd", DPBU) RATE("vpdpwssd", DPWS) RATE("vfmadd231ps", FMA)
  const size_t n = size_t{400} << 20;
  char* b = static_cast<char*>(aligned_alloc(64, n));
  memset(b, 1, n);
  for (int work : {0, 16, 32})
    for (int prefetch : {0, 1}) {
      double best = 0;
      for (int r = 0; r < 4; r++) { double g = stream(b, n, work, prefetch); best = g > best ? g : best; }
      printf("read with %2d vpdpbusd / 256 bytes, %s: %.1f GB/s\n", work,
             prefetch ? "prefetch into L2" : "no prefetch     ", best);
    }
}
"""


def main() -> None:
    with tempfile.TemporaryDirectory() as folder:
        source, binary = os.path.join(folder, "rates.cpp"), os.path.join(folder, "rates")
        with open(source, "w") as f:
            f.write(SOURCE)
        subprocess.run(["g++", "-O2", "-march=native", "-fopenmp", source, "-o", binary], check=True)
        subprocess.run([binary], check=True, env={**os.environ, "OMP_NUM_THREADS": "2"})


if __name__ == "__main__":
    main()
