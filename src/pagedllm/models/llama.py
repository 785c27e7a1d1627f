"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, SmolLM; Mixtral and Qwen3-MoE with the
mixture-of-experts MLP of moe.py) in plain PyTorch.

One flat batch of tokens from many sequences, no padding. Weights use the canonical names
of pagedllm.weights; the KV cache and attention metadata are passed in, never global. The
model holds no load logic: models/build.py loads the decoder stack's weights, picks its
linear layers, and then constructs the model complete from its parts (embedding, stack,
output head, decode loop). Shapes: T = tokens in the step, H = hidden size, D = head dim.
"""
from __future__ import annotations

import torch
from torch import nn

from pagedllm.attention import AttentionMetadata, BatchedBackend, LayerKVCache, TorchReferenceBackend
from pagedllm.attention.softcap import SoftcapBackend
from pagedllm.backends import Backend
from pagedllm.model_config import ModelConfig
from pagedllm.models.decode_loop import DecodeLoop
from pagedllm.models.gemma import SandwichDecoderLayer
from pagedllm.models.moe import MoE
from pagedllm.models.output_head import TokenEmbedding


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, ops):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.eps = eps
        self.ops = ops

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """norm(x); with a residual: residual += x in place, then norm(residual)."""
        return self.ops.rms_norm(x, residual, self.weight, self.eps)


class RotaryEmbedding:
    """Rotate-half RoPE tables: float32 cos/sin [max_positions, D], indexed by position.
    A plain object, not a module: model.to(bfloat16) must leave the tables float32.

    Partial rotary (rotary_dim < D, Phi-4-mini): the q/k weights are permuted at build time
    (models/build.py, rotary_permutation) so that the dimensions that pass through sit at
    the end of each half of the head, where these tables hold cos 1 and sin 0: the kernels
    rotate whole heads as before. attention_factor scales the rotated part (LongRoPE)."""

    def __init__(self, head_dim: int, max_positions: int, theta: float,
                 freq_factors: tuple[float, ...] | None = None, *, rotary_dim: int | None = None,
                 attention_factor: float = 1.0):
        rotary_dim = rotary_dim or head_dim
        inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
        if freq_factors is not None:  # RoPE scaling (Llama 3, linear, LongRoPE): weights/rope.py
            inv_freq = inv_freq / torch.tensor(freq_factors, dtype=torch.float32)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        cos, sin = freqs.cos() * attention_factor, freqs.sin() * attention_factor
        passing = (head_dim - rotary_dim) // 2
        if passing:
            cos = torch.cat([cos, torch.ones(max_positions, passing)], dim=-1)
            sin = torch.cat([sin, torch.zeros(max_positions, passing)], dim=-1)
        self.cos = torch.cat([cos, cos], dim=-1)  # [max_positions, D]
        self.sin = torch.cat([sin, sin], dim=-1)

    @classmethod
    def for_config(cls, config: ModelConfig, long: bool = False) -> RotaryEmbedding:
        """The full-attention layers' tables; long: LongRoPE's long factors."""
        factors = config.rope_long_freq_factors if long else config.rope_freq_factors
        return cls(config.head_dim, config.max_position_embeddings, config.rope_theta, factors,
                   rotary_dim=config.rotary_dim, attention_factor=config.rope_attention_factor)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding, backend: str, ops,
                 kernels, layer_index: int = 0, prefill_sdpa: bool = False):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            config.num_heads, config.num_kv_heads, config.head_dim)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        # q, k and v projections fused into one matrix: one GEMM instead of three.
        self.qkv_proj = nn.Linear(config.hidden_size, q_size + 2 * kv_size,
                                  bias=config.attention_bias)
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=False)
        self.q_size, self.kv_size = q_size, kv_size
        # Qwen3 normalizes each head of q and k (over D) before RoPE.
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, ops) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, ops) if config.qk_norm else None
        self.rotary = rotary
        self.ops = ops
        # Sliding-window layers (all of Mistral's, every other of Gemma's): the window applies
        # here, and interleaved ones read their own block tables (meta.window) when the cache
        # keeps them apart.
        self.window = config.sliding_window if config.slides(layer_index) else None
        # Gemma's and Mistral's options: the batched backend's kernels take them; the
        # reference backend leaves them to the plain-torch SoftcapBackend.
        options = {name: value for name, value in (("scale", config.attn_scale),
                   ("softcap", config.attn_softcap), ("window", self.window)) if value is not None}
        shape = (self.num_heads, self.num_kv_heads, self.head_dim)
        if backend == "batched":
            self.backend = BatchedBackend(*shape, kernels, prefill_sdpa=prefill_sdpa, **options)
        elif backend == "triton":
            from pagedllm.attention.triton_backend import TritonBackend

            self.backend = TritonBackend(*shape, **options)
        elif options:
            self.backend = SoftcapBackend(*shape, **options)
        else:
            self.backend = TorchReferenceBackend(*shape)

    def forward(self, positions, hidden, kv_cache, meta: AttentionMetadata):
        if self.window is not None and meta.window is not None:
            meta = meta.window
        qkv = self.qkv_proj(hidden)
        if self.q_norm is not None:
            qkv = self._norm_heads(qkv)
        # RoPE on q and k, and this step's K/V stored at their slots, in one op.
        q = self.ops.rope_write_kv(qkv, positions, self.rotary.cos,
                                   self.rotary.sin, kv_cache.key, kv_cache.value, meta.slot_mapping,
                                   self.num_heads, kv_cache.key_scale, kv_cache.value_scale)
        return self.o_proj(self.backend.forward(q, kv_cache, meta))

    def _norm_heads(self, qkv: torch.Tensor) -> torch.Tensor:
        """[T, (nh + 2 nkv) D]: q and k normed per head, v as it is."""
        tokens, d = qkv.shape[0], self.head_dim
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q.reshape(-1, d).contiguous()).reshape(tokens, self.q_size)
        k = self.k_norm(k.reshape(-1, d).contiguous()).reshape(tokens, self.kv_size)
        return torch.cat([q, k, v], dim=-1)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, ops):
        super().__init__()
        # gate and up projections fused: one GEMM, then SiLU(gate) * up.
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.ops = ops

    def forward(self, x):
        return self.down_proj(self.ops.silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding, backend: str, ops, kernels,
                 prefill_sdpa: bool = False):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.self_attn = Attention(config, rotary, backend, ops, kernels, prefill_sdpa=prefill_sdpa)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.mlp = MoE(config, ops) if config.num_experts else MLP(config, ops)

    def forward(self, positions, hidden, residual, kv_cache, meta):
        """Pre-norm residual block. The residual stream is carried separately and the adds are
        fused into the norms: returns (this layer's MLP output, residual before adding it)."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, kv_cache, meta)
        hidden = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class DecoderStack(nn.Module):
    """The decoder layers and the final norm, on the backend's ops and attention. Built empty;
    build.py loads the checkpoint's weights into it as into any nn.Module."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, backend: Backend,
                 attention_backend: str = "batched"):
        """backend: the kernels chosen for this process (backends/); attention_backend
        "torch-reference" runs plain torch everywhere, the oracle the kernels are tested
        against."""
        super().__init__()
        self.config = config
        self.dtype = dtype
        rotary = self.rotary = RotaryEmbedding.for_config(config)
        # Gemma 3's sliding layers rotate with their own base, unscaled.
        local_rotary = rotary if config.local_rope_theta is None else RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.local_rope_theta)
        # The reference attention backend runs with the torch layer ops too: a pure-torch oracle.
        reference = attention_backend == "torch-reference"
        ops = backend.layer_ops(reference)
        kernels = None if reference else backend.kernels
        sdpa = not reference and backend.prefill_sdpa
        self.layers = nn.ModuleList(
            self._layer(config, local_rotary if i in config.sliding_layers else rotary,
                        attention_backend, ops, kernels, i, sdpa)
            for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)

    @staticmethod
    def _layer(config: ModelConfig, rotary, backend: str, ops, kernels, index: int,
               prefill_sdpa: bool) -> nn.Module:
        if config.sandwich_norms:  # Gemma 2 and 3
            return SandwichDecoderLayer(
                config, Attention(config, rotary, backend, ops, kernels, index, prefill_sdpa),
                lambda: RMSNorm(config.hidden_size, config.rms_norm_eps, ops))
        return DecoderLayer(config, rotary, backend, ops, kernels, prefill_sdpa)

    def serve_context(self, max_model_len: int) -> bool:
        """LongRoPE: rotate with the long factors when the served context is longer than the
        original one, for every request alike (as llama.cpp picks by its context size;
        transformers switches per forward pass, and a KV cache cannot follow that). The
        tables change in place: every layer and the decode loop hold these tensors.
        True when the long factors were chosen."""
        config = self.config
        if config.rope_long_freq_factors is None or max_model_len <= config.rope_original_context:
            return False
        long = RotaryEmbedding.for_config(config, long=True)
        self.rotary.cos.copy_(long.cos)
        self.rotary.sin.copy_(long.sin)
        return True


class LlamaForCausalLM(nn.Module):
    """Constructed complete from its parts (build.py makes them): one forward path, embedding
    -> decoder layers -> final norm, and logits from the output head."""

    def __init__(self, stack: DecoderStack, embedding: TokenEmbedding, head,
                 decode_loop: DecodeLoop | None = None):
        """head(hidden [N, H]) -> float32 logits [N, vocab] (output_head.py); decode_loop: the
        C++ loop over every layer, where the layers run the fast bfloat16 path throughout."""
        super().__init__()
        self.stack = stack
        self.config, self.dtype = stack.config, stack.dtype
        self.embedding = embedding
        self.head = head
        self.decode_loop = decode_loop
        self.lora = None  # its LoRA slots (lora/slots.py), when adapters are served

    @property
    def layers(self) -> nn.ModuleList:
        return self.stack.layers

    def serve_context(self, max_model_len: int) -> bool:
        return self.stack.serve_context(max_model_len)

    def to_device(self, device: str) -> LlamaForCausalLM:
        """Every tensor of the model on `device` (the generic backend's; build.py): the
        layers' parameters, the RoPE tables (plain objects, shared by layers: moved once
        each), the embedding and the head."""
        if device == "cpu":
            return self
        self.stack.to(device)
        rotaries = {id(m.rotary): m.rotary for m in self.stack.modules()
                    if isinstance(m, Attention)}
        for rotary in [self.stack.rotary, *rotaries.values()]:
            rotary.cos, rotary.sin = rotary.cos.to(device), rotary.sin.to(device)
        tied = getattr(self.head, "weight", None) is self.embedding.weight
        self.embedding.to_device(device)
        # (tied: one matrix on the device, as on the host)
        self.head.to_device(device, self.embedding.weight if tied else None)
        return self

    @property
    def max_graph_batch(self) -> int | None:
        """The largest decode step a CUDA graph can capture: any (None) for a dense model; a
        mixture of experts' steps whose pairs run on the device (moe.py), none (0) where they
        cannot (it counts each expert's tokens on the host to size its GEMMs)."""
        if not self.config.num_experts:
            return None
        return self.stack.layers[0].mlp.max_device_tokens()

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[LayerKVCache], meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions [T] -> final-normed hidden states [T, H] in the model dtype."""
        hidden = self.embedding(input_ids, self.dtype)
        hidden, residual = self._decoder_layers(positions, hidden, kv_caches, meta)
        return self.stack.norm(hidden, residual)

    def _decoder_layers(self, positions, hidden, kv_caches, meta):
        """Every layer in turn: in one C++ call when the step is all decode tokens and the
        loop applies (bit-identical, without the interpreter between layers), else here."""
        if (self.decode_loop is not None and self.decode_loop.applies(meta, hidden.shape[0])
                and (self.lora is None or not self.lora.active
                     or self.decode_loop.lora is self.lora)):  # (LoRA where it has the slots)
            return self.decode_loop(hidden, positions, kv_caches, meta)
        residual = None
        for layer, kv_cache in zip(self.stack.layers, kv_caches):
            hidden, residual = layer(positions, hidden, residual, kv_cache, meta)
        return hidden, residual

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, H] -> [N, vocab] float32 logits; call it only for the rows that are sampled."""
        logits = self.head(hidden)
        cap = self.config.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap  # Gemma 2
