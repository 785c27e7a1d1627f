// Fused element-wise ops of a decoder layer. Each replaces 5-20 small torch ops, which on
// this CPU cost more in dispatch and extra passes over memory than in arithmetic: a decode
// step of the default model ran ~1,500 torch ops. Math is float32; bfloat16 results are
// rounded once, to nearest even.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "dtype.h"
#include "paged_cache.h"

namespace {

using pagedllm::Cvt;
using pagedllm::dispatch;

// Rows per task: decode batches (a few rows) run on the calling thread, prefill in parallel.
constexpr int64_t kRowGrain = 32;

template <typename T>
void rms_norm_impl(const T* x, T* residual, const T* weight, T* out, int64_t rows,
                   int64_t hidden, float eps) {
  at::parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
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
  at::parallel_for(0, tokens, kRowGrain, [&](int64_t begin, int64_t end) {
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
  at::parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
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

void check_rows(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.is_contiguous(), name, " must be a contiguous 2-D tensor");
  TORCH_CHECK(t.scalar_type() == torch::kFloat || t.scalar_type() == torch::kBFloat16,
              name, " must be float32 or bfloat16");
}

}  // namespace

// out = rms_norm(x) * weight. With residual: residual += x first (in place) and the sum is
// normalised, the pre-norm residual pattern of Llama layers. x, residual [T, H]; weight [H].
torch::Tensor rms_norm(torch::Tensor x, c10::optional<torch::Tensor> residual,
                       torch::Tensor weight, double eps) {
  check_rows(x, "x");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1) &&
              weight.scalar_type() == x.scalar_type(), "weight must be [H] in x's dtype");
  if (residual) {
    check_rows(*residual, "residual");
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->scalar_type() == x.scalar_type(),
                "residual must match x");
  }
  auto out = torch::empty_like(x);
  dispatch(x.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    rms_norm_impl<scalar_t>(x.data_ptr<scalar_t>(),
                            residual ? residual->data_ptr<scalar_t>() : nullptr,
                            weight.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), x.size(0),
                            x.size(1), static_cast<float>(eps));
  });
  return out;
}

// qkv [T, (H + 2 KVH) D] -> q [T, H, D] with RoPE applied; K (rotated) and V are written to
// their slots of the paged caches [blocks, block_size, KVH, D]: in qkv's dtype, or int8 with
// their scales [blocks, block_size, KVH] float32. cos/sin [positions, D] f32.
torch::Tensor rope_write_kv(torch::Tensor qkv, torch::Tensor positions, torch::Tensor cos,
                            torch::Tensor sin, torch::Tensor key_cache, torch::Tensor value_cache,
                            torch::Tensor slot_mapping, int64_t num_heads,
                            c10::optional<torch::Tensor> key_scales,
                            c10::optional<torch::Tensor> value_scales) {
  check_rows(qkv, "qkv");
  const bool quantized = check_cache_pair(key_cache, value_cache, key_scales, value_scales,
                                          qkv.scalar_type());
  TORCH_CHECK(cos.scalar_type() == torch::kFloat && sin.scalar_type() == torch::kFloat &&
              cos.is_contiguous() && sin.is_contiguous(), "cos/sin must be contiguous float32");
  TORCH_CHECK(positions.scalar_type() == torch::kInt64 && slot_mapping.scalar_type() == torch::kInt64,
              "positions and slot_mapping must be int64");
  positions = positions.contiguous();
  slot_mapping = slot_mapping.contiguous();
  const int64_t tokens = qkv.size(0), kv_heads = key_cache.size(2), head_dim = key_cache.size(3);
  TORCH_CHECK(qkv.size(1) == (num_heads + 2 * kv_heads) * head_dim && head_dim % 2 == 0 &&
              cos.size(1) == head_dim, "qkv width does not match the heads");
  TORCH_CHECK(positions.numel() == tokens && slot_mapping.numel() == tokens, "one position and slot per token");
  const int64_t num_slots = key_cache.size(0) * key_cache.size(1);
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(pos[t] >= 0 && pos[t] < cos.size(0), "position out of the RoPE table");
    TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "slot out of the cache");
  }
  auto q = torch::empty({tokens, num_heads, head_dim}, qkv.options());
  dispatch(qkv.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    const auto run = [&](auto* key, auto* value, float* ks, float* vs) {
      rope_write_kv_impl(qkv.data_ptr<scalar_t>(), pos, cos.data_ptr<float>(), sin.data_ptr<float>(),
                         key, value, ks, vs, slots, q.data_ptr<scalar_t>(), tokens, num_heads,
                         kv_heads, head_dim);
    };
    if (quantized)
      run(key_cache.data_ptr<int8_t>(), value_cache.data_ptr<int8_t>(), key_scales->data_ptr<float>(),
          value_scales->data_ptr<float>());
    else
      run(key_cache.data_ptr<scalar_t>(), value_cache.data_ptr<scalar_t>(), nullptr, nullptr);
  });
  return q;
}

// x [T, 2I] (gate then up) -> silu(gate) * up [T, I].
torch::Tensor silu_and_mul(torch::Tensor x) {
  check_rows(x, "x");
  TORCH_CHECK(x.size(1) % 2 == 0, "x must hold gate and up halves");
  auto out = torch::empty({x.size(0), x.size(1) / 2}, x.options());
  dispatch(x.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    silu_and_mul_impl<scalar_t>(x.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), x.size(0),
                                x.size(1) / 2);
  });
  return out;
}
