"""Frozen configuration records shared by every part of pagedllm.

`ModelConfig` describes a checkpoint (read from GGUF metadata or config.json);
`CacheConfig` and `SchedulerConfig` are the engine's knobs. They hold data only:
the code that derives one from another lives next to its user.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # "llama", "mistral" or "qwen2"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False  # Qwen2 has q/k/v biases
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    name: str = "model"

    @property
    def kv_bytes_per_token_per_element(self) -> int:
        """K and V, every layer: the element count one token takes in the KV cache."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim


# "auto": K/V in the model's dtype; "int8": codes with a scale per row (attention/layer_cache.py).
KV_CACHE_DTYPES = ("auto", "int8")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    num_blocks: int = 0  # 0 until sized from kv_cache_memory
    enable_prefix_caching: bool = True
    cache_dtype: str = "auto"  # one of KV_CACHE_DTYPES


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 512
    max_model_len: int = 2048
