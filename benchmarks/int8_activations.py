"""What rounding activations to int8 (q4_q8_gemm) costs in accuracy and gains in speed.

    .venv/bin/python benchmarks/int8_activations.py [--threads 2]

The bfloat16 model with three settings of its 4-bit projections for batches above
q4_exact_max_rows (per level and vendor) rows: exact activations everywhere (q4_gemm), int8
everywhere (q4_q8_gemm), and the default, int8 except the EXACT_EDGE_LAYERS layers at each end. For
each: every position's logits of six real-text prompts (22-600 tokens, each prefilled in
one batch) against the float32 model (mean |logit difference|, greedy agreement), and the
time of those prefills, as a ratio to the exact setting.

On a CPU with AMX tiles no step rounds activations to int8 (the tiles keep them exact), so
there the script turns the tiles off (PAGEDLLM_CPU_AMX=0 unless set) to measure the rounding
the other CPUs serve.
"""
from __future__ import annotations

import os
import time

# Before pagedllm reads the CPU's capabilities.
os.environ.setdefault("PAGEDLLM_CPU_AMX", "0")

import torch  # noqa: E402

from pagedllm import LLM  # noqa: E402
from pagedllm.attention import AttentionMetadata, LayerKVCache  # noqa: E402
from pagedllm.kernels import capabilities  # noqa: E402
from pagedllm.models.build import EXACT_EDGE_LAYERS  # noqa: E402
from pagedllm.models.quant_linear import ALL_ROWS, QuantLinear, q4_exact_max_rows  # noqa: E402
from pagedllm.tools.text_prompts import make_prompt_token_ids  # noqa: E402
from timing import parse_args, smoke_or  # noqa: E402

BLOCK = 16


def prompt_logits(model, ids: list[int]) -> torch.Tensor:
    """Every position's float32 logits, the whole prompt prefilled in one step."""
    blocks = -(-len(ids) // BLOCK)
    shape = (blocks, BLOCK, model.config.num_kv_heads, model.config.head_dim)
    kv = [LayerKVCache(torch.zeros(shape, dtype=model.dtype), torch.zeros(shape, dtype=model.dtype))
          for _ in range(model.config.num_layers)]
    meta = AttentionMetadata.build(list(range(len(ids))), [0, len(ids)], [len(ids)],
                                   [list(range(blocks))], BLOCK)
    hidden = model(torch.tensor(ids), torch.arange(len(ids)), kv, meta)
    return model.compute_logits(hidden).float()


def set_int8_layers(model, int8_layers: set[int]) -> None:
    vendor = capabilities().vendor
    for i, layer in enumerate(model.layers):
        for linear in layer.modules():
            if isinstance(linear, QuantLinear):
                linear.exact_max_rows = (q4_exact_max_rows(linear.q4_ops.isa(), vendor) if i in int8_layers
                                         else ALL_ROWS)


def main() -> None:
    parse_args()
    exact_llm = LLM(dtype="float32", kv_cache_memory=16 << 20)
    # The rounding asked for: the default model is small enough to keep exact activations.
    fast = LLM(dtype="bfloat16", exact_activations=False, kv_cache_memory=16 << 20)
    model = fast.engine.runner.model
    if not any(isinstance(m, QuantLinear) and m.exact_max_rows < ALL_ROWS for m in model.modules()):
        print("no C++ kernels here (PAGEDLLM_NO_KERNELS, or no compiler): nothing to compare")
        return
    tokenizer = fast.tokenizer
    prompts = [tokenizer.encode("Once upon a time, in a small village by the sea, there lived an "
                                "old fisherman. The fisherman's daughter walked to the harbour.")]
    prompts += make_prompt_token_ids(tokenizer, smoke_or([64, 150, 300, 450, 600], [16]), seed=3)
    references = [prompt_logits(exact_llm.engine.runner.model, ids) for ids in prompts]
    layers = len(model.layers)
    settings = {"exact": set(),
                "int8 everywhere": set(range(layers)),
                f"int8, {EXACT_EDGE_LAYERS} exact layers each end (default from 1B)":
                    set(range(EXACT_EDGE_LAYERS, layers - EXACT_EDGE_LAYERS))}
    print(f"{len(prompts)} prompts, {sum(map(len, prompts))} tokens; bfloat16 against float32")
    print(f"{'setting':<42} {'mean |diff|':>11} {'agreement':>10} {'prefill s':>10} {'speed-up':>9}")
    base = None
    for name, int8_layers in settings.items():
        set_int8_layers(model, int8_layers)
        prompt_logits(model, prompts[0])  # warm-up
        errors, agree, seconds = [], [], 0.0
        for ids, ref in zip(prompts, references):
            start = time.perf_counter()
            logits = prompt_logits(model, ids)
            seconds += time.perf_counter() - start
            errors.append((logits - ref).abs().mean().item())
            agree.append((logits.argmax(-1) == ref.argmax(-1)).float().mean().item())
        base = base or seconds
        print(f"{name:<42} {sum(errors) / len(errors):11.3f} {sum(agree) / len(agree):10.3f}"
              f" {seconds:10.2f} {base / seconds:8.2f}x")


if __name__ == "__main__":
    main()
