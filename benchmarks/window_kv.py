"""What keeping the sliding-window layers' KV in their own pool saves (core/kv_cache/window.py).

    .venv/bin/python benchmarks/window_kv.py [--threads 2]

1. Arithmetic, Gemma 3's published shapes (bfloat16 KV, 16-token blocks): KV bytes of one
   request at 8k / 32k / 128k tokens when every layer keeps the whole context (what pagedllm
   did before) against the window layers keeping their window (sizing.kv_bytes_per_request),
   and how many such requests 8 GiB of KV holds either way.
2. Measured: a random Gemma 3-shaped model (6 layers, 5 sliding with a 64-token window, the
   layout of the real ones at a toy size) serves one 2,000-token request through the
   engine; the window pool's peak against the full pool's, sampled every step.
"""
from __future__ import annotations

import dataclasses
import os
import sys
import tempfile

import torch

from pagedllm.model_config import ModelConfig
from pagedllm.core import sizing
from timing import parse_args

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from tiny_models import write_hf_folder  # noqa: E402

GEMMA3 = {  # layers, KV heads, head_dim, window (config.json of each size)
    "gemma-3-1b": (26, 1, 256, 512),
    "gemma-3-4b": (34, 4, 256, 1024),
    "gemma-3-12b": (48, 8, 256, 1024),
    "gemma-3-27b": (62, 16, 128, 1024),
}
CONTEXTS = (8192, 32768, 131072)
BUDGET = 8 << 30


def shape(layers: int, kv_heads: int, head_dim: int, window: int | None) -> ModelConfig:
    return ModelConfig(architecture="gemma3_text", vocab_size=262144, hidden_size=2048,
                       intermediate_size=8192, num_layers=layers, num_heads=8,
                       num_kv_heads=kv_heads, head_dim=head_dim, rms_norm_eps=1e-6,
                       rope_theta=1e6, max_position_embeddings=131072, tie_word_embeddings=True,
                       sliding_window=window,
                       sliding_layers=tuple(i for i in range(layers) if i % 6 < 5))


def arithmetic() -> None:
    print("KV per request (bfloat16, 16-token blocks): every layer the whole context -> "
          "window layers their window; requests in 8 GiB")
    for name, (layers, kv_heads, head_dim, window) in GEMMA3.items():
        windowed = shape(layers, kv_heads, head_dim, window)
        full = dataclasses.replace(windowed, sliding_window=None, sliding_layers=())
        for context in CONTEXTS:
            before = sizing.kv_bytes_per_request(full, 2, "auto", context, 16)
            after = sizing.kv_bytes_per_request(windowed, 2, "auto", context, 16)
            print(f"  {name:<12} {context:>7} tokens: {before / 2**30:6.2f} GiB -> "
                  f"{after / 2**30:5.2f} GiB ({before / after:4.1f}x less); "
                  f"{BUDGET // before:>4} -> {BUDGET // after:>4} requests")


def measured() -> None:
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    from pagedllm import LLM, SamplingParams

    torch.manual_seed(0)
    config = Gemma3TextConfig(vocab_size=260, hidden_size=64, intermediate_size=128,
                              num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
                              head_dim=32, sliding_window=64, max_position_embeddings=4096,
                              query_pre_attn_scalar=32, pad_token_id=3, bos_token_id=1,
                              eos_token_id=0)
    with tempfile.TemporaryDirectory() as folder:
        write_hf_folder(Gemma3ForCausalLM(config), folder)  # the tests' toy tokenizer too
        llm = LLM(folder, kv_cache_memory=64 << 20, block_size=16)
        engine = llm.engine
        window = engine.kv_manager.window
        engine.add_request(None, [5 + i % 200 for i in range(1500)],
                           SamplingParams(max_tokens=500, temperature=0, ignore_eos=True))
        window_peak = full_peak = 0
        while engine.has_unfinished_requests():
            engine.step()
            window_peak = max(window_peak, window.pool.num_used_blocks)
            full_peak = max(full_peak, engine.kv_manager.pool.num_used_blocks)
    per_block_layer = sizing.kv_bytes_per_token(engine.model_config, 4) // 6 * 16
    held = (full_peak * 1 + window_peak * 5) * per_block_layer
    every = full_peak * 6 * per_block_layer
    print(f"measured, one 2,000-token request (1,500 prompt in 256-token chunks + 500 decoded), "
          f"64-token window: full pool peak {full_peak} blocks, window pool peak "
          f"{window_peak} blocks; KV held {held / 2**20:.2f} MiB against "
          f"{every / 2**20:.2f} MiB with every layer keeping the context ({every / held:.1f}x)")


def main() -> None:
    parse_args()
    arithmetic()
    measured()


if __name__ == "__main__":
    main()
