"""Hugging Face checkpoint folder (config.json + *.safetensors) -> Checkpoint."""
from __future__ import annotations

import glob
import json
import os

import torch

from pagedllm.model_config import ModelConfig
from pagedllm.errors import ModelLoadError
from pagedllm.weights.rope import RopeScalingError, hf_longrope, hf_rope_factors, rope_kind

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe", "phi3",
                         "gemma2", "gemma3_text")
GEMMAS = ("gemma2", "gemma3_text")


def _read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as exc:
        raise ModelLoadError(path, f"invalid JSON: {exc}") from exc


def _sliding_window(raw: dict) -> int | None:
    """Mistral's window; Qwen2 names one too but uses it only with use_sliding_window."""
    window = raw.get("sliding_window")
    if window is None or (raw.get("model_type") in ("qwen2", "qwen3", "qwen3_moe")
                          and not raw.get("use_sliding_window")):
        return None
    window = int(window)
    return window if window < int(raw.get("max_position_embeddings", 2048)) else None


def hf_model_config(folder: str, raw: dict) -> ModelConfig:
    path = os.path.join(folder, "config.json")
    model_type = raw.get("model_type")
    if model_type == "gemma3" or "text_config" in raw:
        raise ModelLoadError(path, "this is Gemma 3 with its vision tower; pagedllm serves the "
                                   "text model (model_type gemma3_text) only")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ModelLoadError(
            path, f"unknown architecture {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    rope = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
    local_theta = raw.get("rope_local_base_freq")  # Gemma 3, transformers 4 form
    if "full_attention" in rope:  # Gemma 3, transformers 5 form: RoPE per kind of layer
        local_theta = rope.get("sliding_attention", {}).get("rope_theta", local_theta)
        rope = rope["full_attention"]
    try:
        hidden = int(raw["hidden_size"])
        num_heads = int(raw["num_attention_heads"])
        eos = raw.get("eos_token_id")
        head_dim = int(raw.get("head_dim") or hidden // num_heads)
        theta = float(raw.get("rope_theta", rope.get("rope_theta", 10000.0)))
        partial = float(raw.get("partial_rotary_factor", rope.get("partial_rotary_factor", 1.0)))
        rotary_dim = int(head_dim * partial)  # Phi-4-mini rotates 3/4 of each head
        if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
            raise ModelLoadError(path, f"partial_rotary_factor {partial:g} of head_dim "
                                       f"{head_dim} rotates no even number of dimensions")
        try:
            rope_factors = hf_rope_factors(rope, rotary_dim, theta)
            longrope = hf_longrope(rope, raw, rotary_dim) if rope_kind(rope) == "longrope" else {}
        except RopeScalingError as exc:
            raise ModelLoadError(path, str(exc)) from exc
        return ModelConfig(
            architecture=model_type,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
            head_dim=head_dim,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rotary_dim=rotary_dim if rotary_dim != head_dim else None,
            **(longrope or {"rope_freq_factors": rope_factors}),
            sliding_window=_sliding_window(raw),
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(raw.get("attention_bias", model_type == "qwen2")),
            qk_norm=model_type in ("qwen3", "qwen3_moe", "gemma3_text"),
            local_rope_theta=float(local_theta) if local_theta else None,
            **_experts(path, model_type, raw),
            **_gemma(path, model_type, raw),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=tuple(eos if isinstance(eos, list) else [eos] if eos is not None else []),
            name=os.path.basename(os.path.normpath(folder)),
        )
    except KeyError as exc:
        raise ModelLoadError(path, f"required field {exc.args[0]!r} is missing") from exc


def _gemma(path: str, model_type: str, raw: dict) -> dict:
    """ModelConfig's Gemma 2 / Gemma 3 fields (none for other families)."""
    if model_type not in GEMMAS:
        return {}
    if raw.get("hidden_activation", raw.get("hidden_act")) not in ("gelu_pytorch_tanh", None):
        raise ModelLoadError(path, f"Gemma activation {raw.get('hidden_activation')!r} is not "
                                   f"supported (gelu_pytorch_tanh is)")
    # Gemma 2 alternates; Gemma 3 has 5 sliding layers to a global one.
    pattern = 2 if model_type == "gemma2" else int(raw.get("sliding_window_pattern", 6))
    layer_types = raw.get("layer_types") or [
        "sliding_attention" if (i + 1) % pattern else "full_attention"
        for i in range(int(raw["num_hidden_layers"]))]
    softcap = raw.get("attn_logit_softcapping")
    final = raw.get("final_logit_softcapping")
    return {"hidden_act": "gelu_tanh", "embedding_scale": True, "sandwich_norms": True,
            "attn_scale": float(raw.get("query_pre_attn_scalar", 256)) ** -0.5,
            "attn_softcap": float(softcap) if softcap else None,
            "final_softcap": float(final) if final else None,
            "sliding_layers": tuple(i for i, kind in enumerate(layer_types)
                                    if kind == "sliding_attention")}


def _experts(path: str, model_type: str, raw: dict) -> dict:
    """ModelConfig's mixture-of-experts fields from config.json (none for dense models)."""
    if model_type == "mixtral":
        return {"num_experts": int(raw["num_local_experts"]),
                "num_experts_per_tok": int(raw["num_experts_per_tok"]),
                "expert_intermediate_size": int(raw["intermediate_size"]), "norm_topk_prob": True}
    if model_type == "qwen3_moe":
        if int(raw.get("decoder_sparse_step", 1)) != 1 or raw.get("mlp_only_layers"):
            raise ModelLoadError(path, "Qwen3-MoE with dense layers between the expert layers "
                                       "(decoder_sparse_step, mlp_only_layers) is not supported yet")
        # Qwen's own files say num_experts; transformers 5 writes num_local_experts.
        return {"num_experts": int(raw.get("num_experts") or raw["num_local_experts"]),
                "num_experts_per_tok": int(raw["num_experts_per_tok"]),
                "expert_intermediate_size": int(raw["moe_intermediate_size"]),
                "norm_topk_prob": bool(raw.get("norm_topk_prob", False))}
    return {}


# Checkpoint names of a mixture of experts -> canonical ones (Qwen3-MoE's are canonical).
_EXPERT_RENAMES = (("block_sparse_moe.gate.", "mlp.router."), ("mlp.gate.", "mlp.router."),
                   ("block_sparse_moe.experts.", "mlp.experts."), (".w1.", ".gate_proj."),
                   (".w3.", ".up_proj."), (".w2.", ".down_proj."))


def canonical_expert_name(name: str) -> str:
    if ".experts." not in name and ".gate.weight" not in name:
        return name
    for old, new in _EXPERT_RENAMES:
        name = name.replace(old, new)
    return name


def load_hf_folder(folder: str, progress=None):
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from pagedllm.weights import Checkpoint

    config_path = os.path.join(folder, "config.json")
    if not os.path.isfile(config_path):
        raise ModelLoadError(folder, "folder has no config.json (expected a Hugging Face checkpoint)")
    config = hf_model_config(folder, _read_json(config_path))
    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        raise ModelLoadError(folder, "folder has no *.safetensors weights")

    weights: dict[str, torch.Tensor] = {}
    for index, file in enumerate(files):
        if progress is not None:
            progress(index + 1, len(files))
        try:
            tensors = load_file(file)
        except (SafetensorError, OSError) as exc:
            raise ModelLoadError(file, f"not a readable safetensors file ({exc})") from exc
        for name, tensor in tensors.items():
            name = name.removeprefix("model.")
            if config.num_experts:
                name = canonical_expert_name(name)
            weights[name] = tensor.float()
            if config.sandwich_norms and name.endswith("norm.weight"):  # q_norm, k_norm too
                # Gemma's norms scale by (1 + w); stored as such, as llama.cpp's GGUF does.
                weights[name] = weights[name] + 1.0
    if "lm_head.weight" not in weights and not config.tie_word_embeddings:
        # Some tied checkpoints omit the flag; a missing head can only mean tied.
        config = ModelConfig(**{**config.__dict__, "tie_word_embeddings": True})
    if "embed_tokens.weight" not in weights:
        raise ModelLoadError(folder, "weights have no embed_tokens.weight")

    tokenizer_source = {"folder": folder}
    tc_path = os.path.join(folder, "tokenizer_config.json")
    if os.path.isfile(tc_path):
        tokenizer_source["tokenizer_config"] = _read_json(tc_path)
    return Checkpoint(path=folder, config=config, weights=weights, tokenizer_source=tokenizer_source)
