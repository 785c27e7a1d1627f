"""ModelConfig: what a checkpoint is (read from GGUF metadata or config.json by weights/),
and what follows from its shape alone. Plain data: no torch."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # "llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe", "phi3", "gemma2", "gemma3_text"
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
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k, before RoPE
    # Mixture of experts (Mixtral, Qwen3-MoE): every layer's MLP is num_experts experts of
    # expert_intermediate_size, num_experts_per_tok of them per token, weighted by the
    # router's softmax (renormalized over the chosen ones when norm_topk_prob). 0: dense.
    # Gemma 2: GeGLU (tanh gelu), embeddings times sqrt(hidden), norms around both the
    # attention and the MLP ("sandwich"), attention scaled by query_pre_attn_scalar and
    # soft-capped, final logits soft-capped; sliding_layers attend within sliding_window.
    hidden_act: str = "silu"  # or "gelu_tanh"
    embedding_scale: bool = False
    sandwich_norms: bool = False
    attn_scale: float | None = None  # None: head_dim ** -0.5
    attn_softcap: float | None = None
    final_softcap: float | None = None
    sliding_layers: tuple[int, ...] = ()  # () with a sliding_window: every layer slides
    local_rope_theta: float | None = None  # Gemma 3: the sliding layers' RoPE base (no scaling)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    name: str = "model"
    # RoPE scaling as a divisor per inverse frequency (weights/rope.py); None: plain RoPE.
    rope_freq_factors: tuple[float, ...] | None = None
    # LongRoPE (Phi-3.5, Phi-4-mini): rope_freq_factors are its short factors; these long
    # ones replace them where the served context is longer than rope_original_context
    # (chosen once, for every request, as llama.cpp does); cos and sin are scaled by
    # rope_attention_factor.
    rope_long_freq_factors: tuple[float, ...] | None = None
    rope_original_context: int | None = None
    rope_attention_factor: float = 1.0
    # Partial rotary embedding (Phi-4-mini: 3/4 of each head): the leading rotary_dim
    # dimensions of each q and k head rotate, the rest pass through. None: all of them.
    rotary_dim: int | None = None
    # Attention looks back at most this many tokens (Mistral: every layer; Gemma: the
    # sliding_layers). None: full attention.
    sliding_window: int | None = None

    def slides(self, layer: int) -> bool:
        """Whether this layer attends within sliding_window."""
        return self.sliding_window is not None and (not self.sliding_layers
                                                    or layer in self.sliding_layers)

    @property
    def kv_bytes_per_token_per_element(self) -> int:
        """K and V, every layer: the element count one token takes in the KV cache."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim


def num_parameters(config: ModelConfig) -> int:
    """The model's weights, counted from its shape (experts all counted)."""
    h, layers = config.hidden_size, config.num_layers
    attention = h * config.head_dim * (2 * config.num_heads + 2 * config.num_kv_heads)
    if config.num_experts:
        mlp = config.num_experts * 3 * h * config.expert_intermediate_size + h * config.num_experts
    else:
        mlp = 3 * h * config.intermediate_size
    embeddings = config.vocab_size * h * (1 if config.tie_word_embeddings else 2)
    return layers * (attention + mlp) + embeddings
