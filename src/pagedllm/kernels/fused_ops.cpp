// Fused element-wise ops of a decoder layer. Each replaces 5-20 small torch ops, which on
// this CPU cost more in dispatch and extra passes over memory than in arithmetic: a decode
// step of the default model ran ~1,500 torch ops. Math is float32; bfloat16 results are
// rounded once, to nearest even.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "dtype.h"
#include "kernels.h"
#include "paged_cache.h"

namespace {

using pagedllm::Cvt;
using pagedllm::dispatch;
using pagedllm::parallel_for;

// Rows per task: decode batches (a few rows) run on the calling thread, prefill in parallel.
constexpr int64_t kRowGrain = 32;

template <typename T>
void rms_norm_impl(const T* x, T* residual, const T* weight, T* out, int64_t rows,
                   int64_t hidden, float eps) {
  parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(hidden);
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * hidden;
      float ss = 0.f;
      if (residual != nullptr) {
        // residual += x, rounded to the activation dtype as torch's add would.
        T* rr = residual + r * hidden;
        for (int64_t i = 0; i < hidden; ++i) {
          const float v = Cvt<T>::round(Cvt<T>::load(xr, i) + Cvt<T>::load(rr, i));
          Cvt<T>::store(rr, i, v);
          buf[i] = v;
          ss += v * v;
        }
      } else {
        for (int64_t i = 0; i < hidden; ++i) {
          const float v = Cvt<T>::load(xr, i);
          buf[i] = v;
          ss += v * v;
        }
      }
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(hidden) + eps);
      T* o = out + r * hidden;
      // Normalised value rounded to the dtype, then times the weight: as Llama's reference.
      for (int64_t i = 0; i < hidden; ++i)
        Cvt<T>::store(o, i, Cvt<T>::round(buf[i] * inv) * Cvt<T>::load(weight, i));
    }
  });
}

// A K or V row into its cache slot: rounded to the cache's dtype, or, for an int8 cache,
// to codes round(x / scale) with scale = max|x| / 127 (the row's own scale, so one large
// row does not coarsen the others).
template <typename C>
inline void store_row(const float* x, C* dst, float*, int64_t n) {
  for (int64_t i = 0; i < n; ++i) Cvt<C>::store(dst, i, x[i]);
}

inline void store_row(const float* x, int8_t* dst, float* scale, int64_t n) {
  float amax = 0.f;
  for (int64_t i = 0; i < n; ++i) amax = std::max(amax, std::abs(x[i]));
  const float inv = amax > 0.f ? 127.f / amax : 0.f;
  for (int64_t i = 0; i < n; ++i)
    dst[i] = static_cast<int8_t>(std::nearbyint(std::min(127.f, std::max(-127.f, x[i] * inv))));
  *scale = amax / 127.f;
}

// C: the cache's element type (T, or int8_t with scales).
template <typename T, typename C>
void rope_write_kv_impl(const T* qkv, const int64_t* positions, const float* cos,
                        const float* sin, C* key_cache, C* value_cache, float* key_scales,
                        float* value_scales, const int64_t* slots, T* q_out, int64_t tokens,
                        int64_t heads, int64_t kv_heads, int64_t head_dim) {
  const int64_t half = head_dim / 2, row = (heads + 2 * kv_heads) * head_dim;
  const int64_t slot_stride = kv_heads * head_dim;
  parallel_for(0, tokens, kRowGrain, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(head_dim);
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cos + positions[t] * head_dim;
      const float* s = sin + positions[t] * head_dim;
      const T* src = qkv + t * row;
      // Rotate-half RoPE: [x1, x2] -> [x1 c - x2 s, x2 c + x1 s], into buf.
      auto rotate = [&](const T* in) {
        for (int64_t d = 0; d < half; ++d) {
          const float x1 = Cvt<T>::load(in, d), x2 = Cvt<T>::load(in, d + half);
          buf[d] = x1 * c[d] - x2 * s[d];
          buf[d + half] = x2 * c[d + half] + x1 * s[d + half];
        }
      };
      for (int64_t h = 0; h < heads; ++h) {
        rotate(src + h * head_dim);
        store_row(buf.data(), q_out + (t * heads + h) * head_dim, nullptr, head_dim);
      }
      const T* k = src + heads * head_dim;
      const T* v = k + kv_heads * head_dim;
      const int64_t slot = slots[t];
      for (int64_t h = 0; h < kv_heads; ++h) {
        rotate(k + h * head_dim);
        store_row(buf.data(), key_cache + slot * slot_stride + h * head_dim,
                  key_scales + slot * kv_heads + h, head_dim);
        for (int64_t d = 0; d < head_dim; ++d) buf[d] = Cvt<T>::load(v, h * head_dim + d);
        store_row(buf.data(), value_cache + slot * slot_stride + h * head_dim,
                  value_scales + slot * kv_heads + h, head_dim);
      }
    }
  });
}

template <typename T>
void silu_and_mul_impl(const T* x, T* out, int64_t rows, int64_t width) {
  parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = x + r * 2 * width;
      const T* up = gate + width;
      T* o = out + r * width;
      for (int64_t i = 0; i < width; ++i) {
        const float g = Cvt<T>::load(gate, i);
        // Clamped so exp stays finite: under -ffast-math the division is a reciprocal
        // estimate, which turns 1 / inf into NaN instead of 0.
        const float e = std::exp(std::min(-g, 80.f));
        Cvt<T>::store(o, i, g / (1.f + e) * Cvt<T>::load(up, i));
      }
    }
  });
}

}  // namespace

namespace pagedllm::kernel {

void rms_norm(DType dtype, const void* x, void* residual, const void* weight, void* out,
              int64_t rows, int64_t hidden, float eps) {
  dispatch(dtype, [&](auto tag) {
    using T = decltype(tag);
    rms_norm_impl<T>(static_cast<const T*>(x), static_cast<T*>(residual), static_cast<const T*>(weight),
                     static_cast<T*>(out), rows, hidden, eps);
  });
}

void rope_write_kv(DType dtype, const void* qkv, const int64_t* positions, const float* cos,
                   const float* sin, const PagedCache& cache, const int64_t* slots, void* q_out,
                   int64_t tokens, int64_t heads) {
  // The caches are written: PagedCache holds them as the readers' const pointers.
  auto* key = const_cast<void*>(cache.key);
  auto* value = const_cast<void*>(cache.value);
  auto* key_scales = const_cast<float*>(cache.key_scales);
  auto* value_scales = const_cast<float*>(cache.value_scales);
  dispatch(dtype, [&](auto tag) {
    using T = decltype(tag);
    const auto run = [&](auto* k, auto* v) {
      rope_write_kv_impl(static_cast<const T*>(qkv), positions, cos, sin, k, v, key_scales,
                         value_scales, slots, static_cast<T*>(q_out), tokens, heads, cache.kv_heads,
                         cache.head_dim);
    };
    if (cache.quantized) run(static_cast<int8_t*>(key), static_cast<int8_t*>(value));
    else run(static_cast<T*>(key), static_cast<T*>(value));
  });
}

void silu_and_mul(DType dtype, const void* x, void* out, int64_t rows, int64_t width) {
  dispatch(dtype, [&](auto tag) {
    using T = decltype(tag);
    silu_and_mul_impl<T>(static_cast<const T*>(x), static_cast<T*>(out), rows, width);
  });
}

}  // namespace pagedllm::kernel
