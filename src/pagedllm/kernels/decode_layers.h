// All decoder layers of a decode step in one call. Every op of a layer already runs in C++
// (the 4-bit GEMMs, the fused layer ops, paged decode attention), but driven from Python each layer
// paid ~40 us of interpreter and module overhead between them: a third of a one-token step
// on the default model. This loop calls the same functions, in the same order, with the
// same arguments, so its results are bit-identical to the Python loop's
// (tests/test_decode_layers.py); the model takes it only for steps where every row is a
// decode token and every projection runs on low-bit codes: 4-bit (q4_linear), Q6_K
// (q6_gemm) or Q8_0 (q8_gemm), or side by side in parts of those (a Q4_K_M file's q/k/v:
// q and k Q4_K, v Q6_K). Part of the binding unit (bindings.cpp): it works on tensors.
#pragma once
#include "tensor_ops.h"

namespace pagedllm::ops {

constexpr size_t kWeightsPerLayer = 6;  // input norm, qkv, o, post-attention norm, gate_up, down

// One projection: its packed parts, each through the kernel its block size names, outputs
// side by side (as StackedLinear concatenates them; the 8-bit kernels' float32 rounded to
// bfloat16 as Int8ActivationLinear rounds it).
inline torch::Tensor lowbit_linear(const torch::Tensor& x, const std::vector<torch::Tensor>& parts,
                            int64_t exact_max_rows, int64_t amx_min_rows, int64_t int16_max_rows) {
  std::vector<torch::Tensor> outs;
  for (const auto& packed : parts) {
    const int64_t block = packed.dim() == 3 ? packed.size(2) : 0;
    if (block == kernel::kQ6PackedBlockBytes)
      outs.push_back(q6_gemm(x, packed).to(at::kBFloat16));
    else if (block == kernel::kQ8PackedBlockBytes)
      outs.push_back(q8_gemm(x, packed).to(at::kBFloat16));
    else
      outs.push_back(q4_linear(x, packed, exact_max_rows, amx_min_rows, int16_max_rows));
  }
  TORCH_CHECK(!outs.empty(), "a projection needs at least one packed part");
  return outs.size() == 1 ? outs[0] : torch::cat(outs, 1);
}

// hidden [T, H]: the step's embedded tokens. weights: per layer, in order, the input norm
// weight, the packed parts of qkv, of o, the post-attention norm weight, the parts of
// gate_up, of down (each a list; a norm's holds its one weight).
// Returns (the last layer's MLP output, the residual stream before adding it), as the
// Python layers do. key_scales, value_scales: per layer for int8 caches, empty otherwise.
// exact_max_rows, per layer, amx_min_rows and int16_max_rows: as QuantLinear's, where
// q4_linear changes kernel. LoRA (lora/slots.py), where a step's tokens use adapters: lora_stacks holds per layer
// and projection (qkv, o, gate_up, down) its A and B stacks (8 a layer; empty: no LoRA),
// lora_part_starts each projection's parts' first columns (4 lists), lora_slots and
// lora_scales each token's slot (-1: the base) and scale; each projection's output then gets
// its adapter products (lora_add), as the Python layers' LoRAProjection adds them.
inline std::vector<torch::Tensor> decode_layers(torch::Tensor hidden, torch::Tensor positions,
                                         torch::Tensor cos, torch::Tensor sin,
                                         std::vector<std::vector<torch::Tensor>> weights,
                                         std::vector<torch::Tensor> key_caches,
                                         std::vector<torch::Tensor> value_caches,
                                         std::vector<torch::Tensor> key_scales,
                                         std::vector<torch::Tensor> value_scales,
                                         torch::Tensor slot_mapping, torch::Tensor block_tables,
                                         torch::Tensor seq_lens, int64_t num_heads, double eps,
                                         double scale, std::vector<int64_t> exact_max_rows,
                                         int64_t amx_min_rows, int64_t int16_max_rows,
                                         std::vector<torch::Tensor> lora_stacks,
                                         std::vector<std::vector<int64_t>> lora_part_starts,
                                         c10::optional<torch::Tensor> lora_slots,
                                         c10::optional<torch::Tensor> lora_scales) {
  const size_t layers = key_caches.size();
  TORCH_CHECK(layers > 0 && value_caches.size() == layers && weights.size() == layers * kWeightsPerLayer,
              "need ", kWeightsPerLayer, " weights and a key and value cache per layer");
  TORCH_CHECK(exact_max_rows.size() == layers, "need a row limit per layer");
  const bool quantized = !key_scales.empty();
  TORCH_CHECK(key_scales.size() == value_scales.size() && (!quantized || key_scales.size() == layers),
              "need key and value scales per layer for int8 caches, none otherwise");
  TORCH_CHECK(hidden.dim() == 2 && seq_lens.numel() == hidden.size(0),
              "one decode token per sequence");
  const bool lora = !lora_stacks.empty();
  TORCH_CHECK(!lora || (lora_stacks.size() == layers * 8 && lora_part_starts.size() == 4 &&
                        lora_slots && lora_scales),
              "LoRA needs A and B for 4 projections a layer, their parts, slots and scales");
  torch::Tensor residual;
  for (size_t l = 0; l < layers; ++l) {
    const std::vector<torch::Tensor>* w = weights.data() + l * kWeightsPerLayer;
    TORCH_CHECK(w[0].size() == 1 && w[3].size() == 1, "a norm's entry holds its one weight");
    torch::Tensor x;
    if (l == 0) {
      residual = hidden;
      x = rms_norm(hidden, c10::nullopt, w[0][0], eps);
    } else {
      x = rms_norm(hidden, residual, w[0][0], eps);
    }
    // Projection k of the layer (0 qkv, 1 o, 2 gate_up, 3 down), with its adapters' products.
    const auto linear = [&](const torch::Tensor& in, const std::vector<torch::Tensor>& parts,
                            size_t k) {
      auto out = lowbit_linear(in, parts, exact_max_rows[l], amx_min_rows, int16_max_rows);
      if (lora) {
        lora_add(out, in.contiguous(), lora_stacks[(l * 4 + k) * 2], lora_stacks[(l * 4 + k) * 2 + 1],
                 *lora_slots, *lora_scales, lora_part_starts[k]);
      }
      return out;
    };
    c10::optional<torch::Tensor> ks, vs;
    if (quantized) {
      ks = key_scales[l];
      vs = value_scales[l];
    }
    auto q = rope_write_kv(linear(x, w[1], 0), positions, cos, sin, key_caches[l], value_caches[l],
                           slot_mapping, num_heads, ks, vs);
    auto attn = paged_decode_attention(q, key_caches[l], value_caches[l], block_tables, seq_lens,
                                       scale, ks, vs);
    x = rms_norm(linear(attn.flatten(1), w[2], 1), residual, w[3][0], eps);
    hidden = linear(silu_and_mul(linear(x, w[4], 2)), w[5], 3);
  }
  return {hidden, residual};
}

}  // namespace pagedllm::ops
