"""Tiny random Llama-family checkpoints written to disk, for tests that need no real model."""
from __future__ import annotations

import json
import os

import numpy as np
import torch

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<pad>"]
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
          "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def byte_level_alphabet() -> list[str]:
    """GPT-2's bytes_to_unicode: the 256 printable characters byte-level BPE uses."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def tiny_hf_model(arch: str = "llama", tie: bool = True, seed: int = 0, **extra):
    """extra: more config fields (rope_scaling, sliding_window, ...), or other values of the
    common ones."""
    from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM,
                              Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig,
                              MixtralConfig, MixtralForCausalLM,
                              Phi3Config, Phi3ForCausalLM,
                              Qwen2Config, Qwen2ForCausalLM,
                              Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM)

    torch.manual_seed(seed)
    common = dict(vocab_size=260, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=tie,
                  bos_token_id=1, eos_token_id=0) | extra
    if arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    elif arch == "qwen3":  # an explicit head_dim, wider than hidden_size / heads, as Qwen3's
        model = Qwen3ForCausalLM(Qwen3Config(**{"head_dim": 64, **common}))
    elif arch == "mixtral":  # 4 experts of 128, 2 a token
        model = MixtralForCausalLM(MixtralConfig(**{"num_local_experts": 4,
                                                    "num_experts_per_tok": 2, **common}))
    elif arch == "qwen3_moe":  # 6 experts of 32, 2 a token, head_dim 32 (explicit)
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**{
            "num_experts": 6, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
            "head_dim": 32, **common}))
    elif arch == "gemma2":  # head_dim 32 (explicit), a 16-token window on every other layer
        # Eager attention: the one that soft-caps scores in every transformers version (5.17,
        # on the GPU machine, picked one that did not: its logits moved by 1.5e-3).
        model = Gemma2ForCausalLM(Gemma2Config(**{"head_dim": 32, "sliding_window": 16,
                                                  "pad_token_id": 3, **common}))
        model.config._attn_implementation = "eager"
    elif arch == "gemma3_text":  # 6 layers: 5 sliding (16 tokens, base 10k), 1 global (1M)
        model = Gemma3ForCausalLM(Gemma3TextConfig(**{
            "head_dim": 32, "sliding_window": 16, "pad_token_id": 3, "num_hidden_layers": 6,
            **{k: v for k, v in common.items() if k not in ("num_hidden_layers", "rope_theta")}}))
    elif arch == "phi3":  # q/k/v and gate/up fused in the checkpoint itself
        model = Phi3ForCausalLM(Phi3Config(**{"pad_token_id": 3, **common}))
    elif arch == "mistral":
        model = MistralForCausalLM(MistralConfig(**common))
    else:
        model = LlamaForCausalLM(LlamaConfig(**common))
    # Random init is small; widen the weights so logits differ meaningfully between tokens.
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    return model.eval()


def write_hf_folder(model, folder, more_special_tokens=(), chat_template: str = CHATML) -> str:
    """config.json + model.safetensors + a byte-level tokenizer.json (with more special
    tokens after the usual four: a model family's markers; the model's vocab_size must
    cover them)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    model.save_pretrained(folder, safe_serialization=True)
    vocab = {ch: i for i, ch in enumerate(byte_level_alphabet())}
    specials = [*SPECIAL_TOKENS, *more_special_tokens]
    for i, tok in enumerate(specials):
        vocab[tok] = 256 + i
    tokenizer = Tokenizer(models.BPE(vocab, []))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(specials)
    tokenizer.save(os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "<|endoftext|>", "chat_template": chat_template}, f)
    return str(folder)


def _permute(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's converter permutation of q/k rows (the one our loader undoes)."""
    rows = weights.shape[0]
    return (weights.reshape(num_heads, 2, rows // num_heads // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


# The gguf package cannot quantize to k-quants or i-quants, so such tensors get random blocks
# with sane scales: the byte offsets of each block's float16 scale fields.
RANDOM_BLOCK_SCALES = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "IQ4_NL": (0,),
                       "IQ4_XS": (0,)}


def random_k_quant_blocks(qtype: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    import gguf

    values_per_block, block_bytes = gguf.GGML_QUANT_SIZES[getattr(gguf.GGMLQuantizationType, qtype)]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows, cols // values_per_block, block_bytes), dtype=np.uint8)
    scale = np.frombuffer(np.float16(0.01).tobytes(), dtype=np.uint8)
    for offset in RANDOM_BLOCK_SCALES[qtype]:
        blocks[:, :, offset:offset + 2] = scale
    return blocks.reshape(rows, -1)


def _gguf_tensors(state_dict):
    """The state dict with each layer's stacked experts as llama.cpp stores them: gate, up
    and down apart ([E, I, H], [E, I, H], [E, H, I]), named so write_gguf maps them."""
    for name, tensor in state_dict.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            gate, up = tensor.chunk(2, dim=1)
            yield name.replace("gate_up_proj", "gate.weight"), gate
            yield name.replace("gate_up_proj", "up.weight"), up
        elif name.endswith("mlp.experts.down_proj"):
            yield name.replace("down_proj", "down.weight"), tensor
        else:
            yield name, tensor


def write_gguf(model, path, qtype: str = "F32", arch: str = "llama",
               rope_freqs: list[float] | None = None, omit: tuple[str, ...] = (),
               qtypes: dict[str, str] | None = None, pooling_type: int | None = None) -> str:
    """Write an HF Llama model as llama.cpp would: GGUF names, permuted q/k, gpt2 tokenizer.
    omit: GGUF tensor names left out (to test what a broken file gets). qtypes: a type per
    GGUF name ending (as a Q4_K_M file mixes Q4_K and Q6_K), qtype for the other matrices.
    pooling_type: an embedding model's (llama.cpp's enum: 1 mean, 3 last)."""
    import gguf

    cfg = model.config
    writer = gguf.GGUFWriter(str(path), arch)
    add_tensor = writer.add_tensor
    writer.add_tensor = lambda name, *a, **k: None if name in omit else add_tensor(name, *a, **k)
    writer.add_name("tiny")
    if pooling_type is not None:
        writer.add_pooling_type(gguf.PoolingType(pooling_type))
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    rope = cfg.rope_parameters
    if "full_attention" in rope:  # Gemma 3: the global layers' RoPE is the file's
        rope = rope["full_attention"]
        if rope.get("rope_type") == "linear":
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(rope["factor"])
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    writer.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))
    if rope.get("rope_type") == "longrope":  # Phi-3.5 / Phi-4-mini, as llama.cpp writes them
        original = rope["original_max_position_embeddings"]
        writer.add_rope_scaling_orig_ctx_len(original)
        writer.add_rope_scaling_attn_factors(model.model.rotary_emb.attention_scaling)
        writer.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))
        writer.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
    if head_dim != cfg.hidden_size // cfg.num_attention_heads:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt2")
    writer.add_token_list(byte_level_alphabet() + SPECIAL_TOKENS)
    writer.add_token_types([1] * 256 + [3] * len(SPECIAL_TOKENS))
    writer.add_token_merges([])
    writer.add_bos_token_id(257)
    writer.add_eos_token_id(256)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHATML)

    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
             "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
             "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
             "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up",  # Phi-3
             "mlp.gate": "ffn_gate_inp", "mlp.experts.gate": "ffn_gate_exps",
             "mlp.experts.up": "ffn_up_exps", "mlp.experts.down": "ffn_down_exps"}
    num_experts = getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", None)
    if num_experts:
        writer.add_expert_count(num_experts)
        writer.add_expert_used_count(cfg.num_experts_per_tok)
        if getattr(cfg, "moe_intermediate_size", None):
            writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if arch in ("gemma2", "gemma3"):  # llama.cpp's names for the sandwich norms, its settings
        names = {**names, "post_attention_layernorm": "post_attention_norm",
                 "pre_feedforward_layernorm": "ffn_norm",
                 "post_feedforward_layernorm": "post_ffw_norm"}
        if arch == "gemma2":
            writer.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
            writer.add_final_logit_softcapping(cfg.final_logit_softcapping)
        writer.add_sliding_window(cfg.sliding_window)
    for name, tensor in _gguf_tensors(model.state_dict()):
        array = tensor.float().numpy()
        if arch in ("gemma2", "gemma3") and name.endswith("norm.weight"):
            array = array + 1.0  # llama.cpp's converter stores Gemma's (1 + w)
        if name == "model.embed_tokens.weight":
            out = "token_embd.weight"
        elif name == "model.norm.weight":
            out = "output_norm.weight"
        elif name == "lm_head.weight":
            if cfg.tie_word_embeddings:
                continue
            out = "output.weight"
        else:
            _, _, layer, rest = name.split(".", 3)
            module, kind = rest.rsplit(".", 1)
            out = f"blk.{layer}.{names[module]}.{kind}"
            if arch == "llama" and module == "self_attn.q_proj":
                array = _permute(array, cfg.num_attention_heads)
            elif arch == "llama" and module == "self_attn.k_proj":
                array = _permute(array, cfg.num_key_value_heads)
        tensor_type = next((t for end, t in (qtypes or {}).items() if out.endswith(end)), qtype)
        qt = getattr(gguf.GGMLQuantizationType, tensor_type)
        if array.ndim == 2 and tensor_type in RANDOM_BLOCK_SCALES:
            writer.add_tensor(out, random_k_quant_blocks(tensor_type, *array.shape), raw_dtype=qt)
        elif array.ndim >= 2 and qt != gguf.GGMLQuantizationType.F32:  # experts are 3-D
            data = gguf.quants.quantize(array, qt)
            writer.add_tensor(out, data, raw_dtype=qt)
        else:
            writer.add_tensor(out, np.ascontiguousarray(array, dtype=np.float32))
    if rope_freqs is not None:  # llama.cpp's form of Llama 3's RoPE scaling
        writer.add_tensor("rope_freqs.weight", np.asarray(rope_freqs, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)
