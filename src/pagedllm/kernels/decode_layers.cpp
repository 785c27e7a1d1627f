// All decoder layers of a decode step in one call. Every op of a layer already runs in C++
// (the 4-bit GEMMs, the fused layer ops, paged decode attention), but driven from Python each layer
// paid ~40 us of interpreter and module overhead between them: a third of a one-token step
// on the default model. This loop calls the same functions, in the same order, with the
// same arguments, so its results are bit-identical to the Python loop's
// (tests/test_decode_layers.py); the model takes it only for steps where every row is a
// decode token and every projection runs on 4-bit codes (q4_linear).
#include "ops.h"

constexpr size_t kWeightsPerLayer = 6;  // input norm, qkv, o, post-attention norm, gate_up, down

// hidden [T, H]: the step's embedded tokens. weights: per layer, in order, the input norm
// weight, packed qkv, packed o, post-attention norm weight, packed gate_up, packed down.
// Returns (the last layer's MLP output, the residual stream before adding it), as the
// Python layers do. key_scales, value_scales: per layer for int8 caches, empty otherwise.
// exact_max_rows, per layer: as QuantLinear's, where q4_linear changes
// kernel.
std::vector<torch::Tensor> decode_layers(torch::Tensor hidden, torch::Tensor positions,
                                         torch::Tensor cos, torch::Tensor sin,
                                         std::vector<torch::Tensor> weights,
                                         std::vector<torch::Tensor> key_caches,
                                         std::vector<torch::Tensor> value_caches,
                                         std::vector<torch::Tensor> key_scales,
                                         std::vector<torch::Tensor> value_scales,
                                         torch::Tensor slot_mapping, torch::Tensor block_tables,
                                         torch::Tensor seq_lens, int64_t num_heads, double eps,
                                         double scale, std::vector<int64_t> exact_max_rows) {
  const size_t layers = key_caches.size();
  TORCH_CHECK(layers > 0 && value_caches.size() == layers && weights.size() == layers * kWeightsPerLayer,
              "need ", kWeightsPerLayer, " weights and a key and value cache per layer");
  TORCH_CHECK(exact_max_rows.size() == layers, "need a row limit per layer");
  const bool quantized = !key_scales.empty();
  TORCH_CHECK(key_scales.size() == value_scales.size() && (!quantized || key_scales.size() == layers),
              "need key and value scales per layer for int8 caches, none otherwise");
  TORCH_CHECK(hidden.dim() == 2 && seq_lens.numel() == hidden.size(0),
              "one decode token per sequence");
  torch::Tensor residual;
  for (size_t l = 0; l < layers; ++l) {
    const torch::Tensor* w = weights.data() + l * kWeightsPerLayer;
    torch::Tensor x;
    if (l == 0) {
      residual = hidden;
      x = rms_norm(hidden, c10::nullopt, w[0], eps);
    } else {
      x = rms_norm(hidden, residual, w[0], eps);
    }
    const auto linear = [&](const torch::Tensor& in, const torch::Tensor& packed) {
      return q4_linear(in, packed, exact_max_rows[l]);
    };
    c10::optional<torch::Tensor> ks, vs;
    if (quantized) {
      ks = key_scales[l];
      vs = value_scales[l];
    }
    auto q = rope_write_kv(linear(x, w[1]), positions, cos, sin, key_caches[l], value_caches[l],
                           slot_mapping, num_heads, ks, vs);
    auto attn = paged_decode_attention(q, key_caches[l], value_caches[l], block_tables, seq_lens,
                                       scale, ks, vs);
    x = rms_norm(linear(attn.flatten(1), w[2]), residual, w[3], eps);
    hidden = linear(silu_and_mul(linear(x, w[4])), w[5]);
  }
  return {hidden, residual};
}
