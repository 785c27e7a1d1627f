// The LoRA adapters' products of one step over every slot its tokens use, in one call per
// projection (Punica's SGMV/BGMV, on the CPU): y[t] += scale[t] * B[slot[t]] @ (A[slot[t]] @ x[t])
// for each token with a slot (slot < 0: the base model's token, left alone), part by part of a
// fused projection (lora/grouped.py has the layout). In torch the
// same took ~7 small ops a projection (gathers, two batched matmuls, a scatter): on the
// default model ~40 ms of a 16-request decode step, against ~0.1 ms here. Math in float32;
// bfloat16 results rounded once.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "dtype.h"
#include "kernels.h"

namespace {

using pagedllm::Cvt;
using pagedllm::dispatch;
using pagedllm::parallel_for;

// Output columns per task of the expand phase: a decode step's few tokens still spread
// over the threads by their columns.
constexpr int64_t kColumnGrain = 256;

template <typename T>
void lora_add_impl(T* y, const T* x, const T* a, const T* b, const int64_t* slots,
                   const float* scales, const std::vector<int64_t>& part_starts,
                   int64_t tokens, int64_t fan_in, int64_t fan_out, int64_t rank) {
  const int64_t parts = static_cast<int64_t>(part_starts.size()) - 1, rows = parts * rank;
  // The tokens with an adapter, by slot: a thread's tokens then share their adapters' weights,
  // read from memory once (the threads do not both stream every adapter).
  std::vector<int64_t> order;
  for (int64_t t = 0; t < tokens; ++t)
    if (slots[t] >= 0) order.push_back(t);
  std::stable_sort(order.begin(), order.end(), [&](int64_t i, int64_t j) { return slots[i] < slots[j]; });
  const int64_t count = static_cast<int64_t>(order.size());
  // Shrink: h[t] = A[slot] @ x[t] (every part's rank rows), scaled by the token's scale.
  std::vector<float> h(static_cast<size_t>(tokens * rows), 0.0f);
  parallel_for(0, count, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> row(fan_in);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t t = order[i];
      for (int64_t k = 0; k < fan_in; ++k) row[k] = Cvt<T>::load(x, t * fan_in + k);
      const T* as = a + slots[t] * rows * fan_in;
      // Four rows at a time: four independent sums, not one chain of dependent adds.
      int64_t j = 0;
      for (; j + 4 <= rows; j += 4) {
        const T *a0 = as + j * fan_in, *a1 = a0 + fan_in, *a2 = a1 + fan_in, *a3 = a2 + fan_in;
        float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
        for (int64_t k = 0; k < fan_in; ++k) {
          const float v = row[k];
          s0 += v * Cvt<T>::load(a0, k);
          s1 += v * Cvt<T>::load(a1, k);
          s2 += v * Cvt<T>::load(a2, k);
          s3 += v * Cvt<T>::load(a3, k);
        }
        float* hj = h.data() + t * rows + j;
        hj[0] = s0 * scales[t], hj[1] = s1 * scales[t], hj[2] = s2 * scales[t], hj[3] = s3 * scales[t];
      }
      for (; j < rows; ++j) {
        const T* aj = as + j * fan_in;
        float acc = 0.0f;
        for (int64_t k = 0; k < fan_in; ++k) acc += row[k] * Cvt<T>::load(aj, k);
        h[t * rows + j] = acc * scales[t];
      }
    }
  });
  // Expand: y[t, cols] += sum_r h[t, p*rank + r] * B[slot, r, cols] for the part p whose
  // columns they are; B's rows are contiguous over the columns, so the inner loop is an axpy.
  const int64_t blocks = (fan_out + kColumnGrain - 1) / kColumnGrain;
  parallel_for(0, count * blocks, 1, [&](int64_t begin, int64_t end) {
    float acc[kColumnGrain];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t t = order[task / blocks], first = (task % blocks) * kColumnGrain;
      const int64_t last = std::min(fan_out, first + kColumnGrain);
      std::fill(acc, acc + (last - first), 0.0f);
      const float* ht = h.data() + t * rows;
      const T* bs = b + slots[t] * rank * fan_out;
      for (int64_t p = 0; p < parts; ++p) {
        const int64_t from = std::max(first, part_starts[p]), to = std::min(last, part_starts[p + 1]);
        for (int64_t r = 0; r < rank && from < to; ++r) {
          const float hv = ht[p * rank + r];
          if (hv == 0.0f) continue;  // a rank the adapter does not fill, or a part it leaves
          const T* br = bs + r * fan_out;
          for (int64_t o = from; o < to; ++o) acc[o - first] += hv * Cvt<T>::load(br, o);
        }
      }
      for (int64_t o = first; o < last; ++o) {
        const int64_t at = t * fan_out + o;
        Cvt<T>::store(y, at, Cvt<T>::load(y, at) + acc[o - first]);
      }
    }
  });
}

}  // namespace

namespace pagedllm::kernel {

void lora_add(DType dtype, void* y, const void* x, const void* a, const void* b,
              const int64_t* slots, const float* scales, const std::vector<int64_t>& part_starts,
              int64_t tokens, int64_t fan_in, int64_t fan_out, int64_t rank) {
  dispatch(dtype, [&](auto tag) {
    using T = decltype(tag);
    lora_add_impl<T>(static_cast<T*>(y), static_cast<const T*>(x), static_cast<const T*>(a),
                     static_cast<const T*>(b), slots, scales, part_starts, tokens, fan_in,
                     fan_out, rank);
  });
}

}  // namespace pagedllm::kernel
