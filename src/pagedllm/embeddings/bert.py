"""A BERT-family encoder (BertModel's layout: learned absolute positions, post-norm layers,
GELU), read from a Hugging Face folder's safetensors: what sentence-transformers models such
as all-MiniLM-L6-v2 run under their pooling. An encoder sees a whole input at once, with no
cache between steps, so it is plain torch here; batches are padded and the padding masked.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagedllm.errors import ModelLoadError


@dataclass(frozen=True)
class BertConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    max_positions: int
    type_vocab_size: int
    layer_norm_eps: float

    @classmethod
    def from_folder(cls, folder: str) -> BertConfig:
        path = os.path.join(folder, "config.json")
        try:
            with open(path, encoding="utf-8") as f:
                raw = json.load(f)
        except (OSError, ValueError) as exc:
            raise ModelLoadError(folder, f"no readable config.json ({exc})") from exc
        if raw.get("model_type") != "bert":
            raise ModelLoadError(folder, f"model_type {raw.get('model_type')!r}: the encoders "
                                         "served for embeddings are BERT's (model_type \"bert\")")
        if raw.get("hidden_act", "gelu") != "gelu" or raw.get("position_embedding_type",
                                                                "absolute") != "absolute":
            raise ModelLoadError(folder, "only GELU and absolute positions are supported")
        return cls(raw["vocab_size"], raw["hidden_size"], raw["num_hidden_layers"],
                   raw["num_attention_heads"], raw["intermediate_size"],
                   raw["max_position_embeddings"], raw.get("type_vocab_size", 2),
                   raw.get("layer_norm_eps", 1e-12))


class BertEncoder:
    """Token ids -> the last layer's hidden states, for a padded batch.

    matmul_dtype: the dtype the layers' matrix products run in. bfloat16 (on CPUs with
    native bf16 products: sentence_model.py chooses) keeps the weights in bf16 and rounds
    each product's input to it, accumulating in float32 inside oneDNN; everything else
    (embeddings, norms, softmax, GELU, the residual stream) stays float32. Vectors stay
    within cosine 0.99995 of float32's (tests/test_embeddings.py) for ~2x the speed of
    float32 GEMMs at batch 64 (BENCHMARKS.md)."""

    def __init__(self, config: BertConfig, weights: dict[str, torch.Tensor],
                 matmul_dtype: torch.dtype = torch.float32):
        self.config = config
        self.matmul_dtype = matmul_dtype
        self.w = {name: (t.to(matmul_dtype) if name.startswith("encoder.") and
                         not name.endswith(("LayerNorm.weight", "LayerNorm.bias")) else t)
                  for name, t in weights.items()}

    @classmethod
    def from_folder(cls, folder: str, matmul_dtype: torch.dtype = torch.float32) -> BertEncoder:
        from safetensors.torch import load_file

        config = BertConfig.from_folder(folder)
        path = os.path.join(folder, "model.safetensors")
        if not os.path.isfile(path):
            raise ModelLoadError(folder, "no model.safetensors")
        raw = load_file(path)
        # BertModel saves its names bare; a BertForXxx checkpoint prefixes them with "bert.".
        weights = {name.removeprefix("bert."): tensor.float().contiguous() for name, tensor in raw.items()}
        missing = [name for name in _expected_names(config) if name not in weights]
        if missing:
            raise ModelLoadError(folder, f"model.safetensors lacks {missing[0]} (and {len(missing) - 1} more)"
                                 if len(missing) > 1 else f"model.safetensors lacks {missing[0]}")
        return cls(config, weights, matmul_dtype)

    @torch.inference_mode()
    def __call__(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """ids, mask [batch, length] (mask 1 for real tokens) -> hidden [batch, length, H]."""
        c, w, dt = self.config, self.w, self.matmul_dtype
        positions = torch.arange(ids.shape[1])
        x = (w["embeddings.word_embeddings.weight"][ids]
             + w["embeddings.position_embeddings.weight"][positions]
             + w["embeddings.token_type_embeddings.weight"][0])
        x = self._norm(x, "embeddings.LayerNorm")
        batch, length, _ = x.shape
        heads, head_dim = c.num_heads, c.hidden_size // c.num_heads
        # Padding keys are never attended to; padded queries' rows are dropped by pooling.
        keep = mask.bool()[:, None, None, :]
        for layer in range(c.num_layers):
            p = f"encoder.layer.{layer}."

            def project(name, t):
                out = F.linear(t.to(dt), w[p + name + ".weight"], w[p + name + ".bias"])
                return out.float()

            def split(t):
                return t.view(batch, length, heads, head_dim).transpose(1, 2)

            q, k, v = (split(project(f"attention.self.{n}", x)) for n in ("query", "key", "value"))
            context = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
            context = context.transpose(1, 2).reshape(batch, length, c.hidden_size)
            x = self._norm(project("attention.output.dense", context) + x, p + "attention.output.LayerNorm")
            hidden = F.gelu(project("intermediate.dense", x))
            x = self._norm(project("output.dense", hidden) + x, p + "output.LayerNorm")
        return x

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return F.layer_norm(x, (self.config.hidden_size,), self.w[name + ".weight"],
                            self.w[name + ".bias"], self.config.layer_norm_eps)


def _expected_names(config: BertConfig) -> list[str]:
    names = ["embeddings.word_embeddings.weight", "embeddings.position_embeddings.weight",
             "embeddings.token_type_embeddings.weight", "embeddings.LayerNorm.weight",
             "embeddings.LayerNorm.bias"]
    for layer in range(config.num_layers):
        p = f"encoder.layer.{layer}."
        for part in ("attention.self.query", "attention.self.key", "attention.self.value",
                     "attention.output.dense", "attention.output.LayerNorm", "intermediate.dense",
                     "output.dense", "output.LayerNorm"):
            names += [p + part + ".weight", p + part + ".bias"]
    return names
