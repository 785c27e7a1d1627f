// A layer's paged K/V cache as the attention kernels read it: [num_blocks, block_size, KVH, D]
// codes in the query's dtype, or int8 codes with a float32 scale per (slot, KV head)
// [num_blocks, block_size, KVH] (kv_cache_dtype "int8": half the bytes of bfloat16, so half
// the memory traffic of decode attention and twice the tokens in the same memory).
#pragma once
#include <cstdint>

// What a layer's attention adds to softmax(q.k * scale) v: soft-capped scores
// (cap * tanh(s / cap), Gemma 2), and a sliding window (a query at position p sees p - window
// + 1 .. p, Mistral and Gemma's local layers). 0: none.
struct AttentionOptions {
  float scale;
  float softcap = 0.f;
  int64_t window = 0;
  // The first position a query sees, when its context is positions 0 .. len - 1.
  int64_t first_visible(int64_t len) const { return window > 0 && len > window ? len - window : 0; }
};

// One KV head's rows: the cache and its scales offset to the head.
template <typename cache_t>
struct HeadRows {
  const cache_t* cache;
  const float* scales;   // null unless int8
  int64_t token_stride;  // elements from one slot to the next (KV heads x head_dim)
  int64_t kv_heads;      // scales from one slot to the next
  int64_t block_size;
};

// A layer's caches as pointers and sizes (bindings.cpp checks the tensors they come from).
struct PagedCache {
  const void* key;
  const void* value;
  const float* key_scales = nullptr;
  const float* value_scales = nullptr;
  int64_t block_size = 0, kv_heads = 0, head_dim = 0;
  bool quantized = false;

  template <typename cache_t>
  HeadRows<cache_t> head_rows(const void* codes, const float* scales, int64_t kv_head) const {
    return {static_cast<const cache_t*>(codes) + kv_head * head_dim,
            scales ? scales + kv_head : nullptr, kv_heads * head_dim, kv_heads, block_size};
  }
};
