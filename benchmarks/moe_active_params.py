"""A mixture of experts costs what its active parameters cost, not its total: decode step
time of a Qwen3-MoE-shaped model (random weights) against two dense Qwen3 models with the
same attention, one whose MLP has the MoE's active size and one with its total size.

    .venv/bin/python benchmarks/moe_active_params.py [--threads 2] [--out bench-results/moe]

Shapes (Qwen3-30B-A3B's proportions, scaled to fit this machine: 128 -> 64 experts, hidden
2048 -> 1024, 48 -> 8 layers): hidden 1024, 8 layers, 16 heads / 4 KV heads of 128, 64
experts of 384 with 8 active per token. Dense "active": intermediate 8 x 384 = 3072; dense
"total": 64 x 384 = 24576. bfloat16 safetensors folders written here (config.json from
transformers' config classes, tensors named as transformers names them), served by the
offline engine; ms per decode step (best of 4 runs of 12) at batch 1 and 8 with 128-token
prompts.
"""
from __future__ import annotations

import argparse
import os
import time

import torch

from timing import add_smoke, smoke_or

LAYERS, HIDDEN, EXPERTS, ACTIVE, EXPERT_INTER = smoke_or(8, 1), 1024, smoke_or(64, 8), smoke_or(8, 2), 384
ATTENTION = dict(num_attention_heads=16, num_key_value_heads=4, head_dim=128)


def write_folder(folder: str, config) -> int:
    """Random bfloat16 weights named as transformers names them; returns their count."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    os.makedirs(folder, exist_ok=True)
    config.to_json_file(os.path.join(folder, "config.json"))
    with torch.device("meta"):
        shapes = {name: p.shape for name, p in AutoModelForCausalLM.from_config(config).state_dict().items()}
    generator = torch.Generator().manual_seed(0)
    tensors = {}
    for name, shape in shapes.items():
        tensor = ((torch.randn(shape, generator=generator) * 0.02).bfloat16() if len(shape) > 1
                  else torch.ones(shape, dtype=torch.bfloat16))
        # transformers holds the experts stacked; checkpoints (and the loader) name each one.
        if name.endswith("mlp.experts.gate_up_proj"):
            prefix = name.removesuffix("gate_up_proj")
            for e, (gate, up) in enumerate(zip(*tensor.chunk(2, dim=1))):
                tensors[f"{prefix}{e}.gate_proj.weight"] = gate.contiguous()
                tensors[f"{prefix}{e}.up_proj.weight"] = up.contiguous()
        elif name.endswith("mlp.experts.down_proj"):
            prefix = name.removesuffix("down_proj")
            for e, down in enumerate(tensor):
                tensors[f"{prefix}{e}.down_proj.weight"] = down.contiguous()
        else:
            tensors[name] = tensor
    save_file(tensors, os.path.join(folder, "model.safetensors"))
    write_default_tokenizer(folder)
    return sum(t.numel() for t in tensors.values())


def write_default_tokenizer(folder: str) -> None:
    """The default model's tokenizer (49,152 tokens), as tokenizer.json."""
    from pagedllm.weights import load_checkpoint
    from pagedllm.tokenizer.gguf import tokenizer_from_gguf

    checkpoint = load_checkpoint(None)
    meta = checkpoint.tokenizer_source["gguf"]
    tokenizer_from_gguf(checkpoint.path, meta).save(os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        f.write('{"eos_token": "<|im_end|>"}')


def configs() -> dict:
    from transformers import Qwen3Config, Qwen3MoeConfig

    common = dict(vocab_size=49152, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
                  max_position_embeddings=4096, tie_word_embeddings=True, **ATTENTION)
    return {
        f"MoE ({EXPERTS} experts, {ACTIVE} active)": Qwen3MoeConfig(
            num_experts=EXPERTS, num_experts_per_tok=ACTIVE, moe_intermediate_size=EXPERT_INTER,
            intermediate_size=EXPERT_INTER, decoder_sparse_step=1, **common),
        "dense, the active size": Qwen3Config(intermediate_size=ACTIVE * EXPERT_INTER, **common),
        "dense, the total size": Qwen3Config(intermediate_size=EXPERTS * EXPERT_INTER, **common),
    }


def decode_ms(folder: str, batch: int) -> float:
    from pagedllm import LLM, SamplingParams

    llm = LLM(folder, dtype="bfloat16", max_num_seqs=batch, kv_cache_memory=256 << 20,
              enable_prefix_caching=False)
    engine = llm.engine
    for i in range(batch):
        prompt = [(37 * i + 11 * j) % 40000 + 100 for j in range(128)]
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=400, temperature=0, ignore_eos=True))
    while any(r.num_computed_tokens < 128 for r in engine.scheduler.requests.values()):
        engine.step()
    for _ in range(3):
        engine.step()
    best = float("inf")
    runs, steps = smoke_or((4, 12), (1, 2))
    for _ in range(runs):  # the best of 4 runs of 12 steps: other work on the host only adds
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        best = min(best, (time.perf_counter() - start) / steps * 1e3)
    return best


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="bench-results/moe")
    add_smoke(parser)
    args = parser.parse_args()
    if args.smoke:
        import tempfile

        args.out = tempfile.mkdtemp(prefix="pagedllm-moe-")
    torch.set_num_threads(args.threads)
    rows = []
    for name, config in configs().items():
        folder = os.path.join(args.out, name.split()[0].strip(",") + "-" + str(config.intermediate_size))
        total = write_folder(folder, config)
        rows.append((name, total, decode_ms(folder, 1), decode_ms(folder, 8)))
    per_layer_expert = 3 * HIDDEN * EXPERT_INTER
    print(f"threads={args.threads}, bfloat16; expert MLP params per layer: total "
          f"{EXPERTS * per_layer_expert / 1e6:.0f}M, active {ACTIVE * per_layer_expert / 1e6:.0f}M")
    print(f"{'model':<28} {'params':>8} {'ms/step b=1':>12} {'ms/step b=8':>12}")
    for name, total, one, eight in rows:
        print(f"{name:<28} {total / 1e6:7.0f}M {one:12.2f} {eight:12.2f}")
    moe, active, full = rows
    print(f"MoE / dense-active: b=1 {moe[2] / active[2]:.2f}x, b=8 {moe[3] / active[3]:.2f}x; "
          f"MoE / dense-total: b=1 {moe[2] / full[2]:.2f}x, b=8 {moe[3] / full[3]:.2f}x")


if __name__ == "__main__":
    main()
