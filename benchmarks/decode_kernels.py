"""Kernels per decode step on the GPU's code path (issue 32), counted here on the CPU: the
generic backend with its Triton attention (under Triton's interpreter), its layer ops in
torch (the baseline: what the first H200 run used) and in Triton, measured in the same run.

On the H200 a CUDA-graph decode step of the 135M model took 3.46 ms and one of the 1.7B
shape 3.78 ms against a 0.88 ms floor: a cost nearly independent of the weights' bytes.
A replayed graph still runs each of its kernels for a few microseconds, so the number of
kernels a step launches is that cost's measure; it is deterministic (no GPU, no timing).

    python benchmarks/decode_kernels.py [--model PATH] [--levels 1,8] [--json OUT.json]

Counts one decode step after the prompts' prefill: the kernels inside one decoder layer,
inside the whole model forward (what a CUDA graph replays), and outside it (the inputs'
copies, the head, sampling). Default model: the bundled SmolLM2-135M (30 layers). Then one
mixture-of-experts layer at N=1, its grouped path against its pairs on the device.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton is imported (CPU tensors)

import torch  # noqa: E402

from timing import add_smoke, smoke_or  # noqa: E402


def count_step(model_path: str | None, layer_ops: str, n: int) -> dict:
    from pagedllm import LLM, SamplingParams
    from pagedllm.backends.cpu import generic_backend
    from pagedllm.backends.launch_count import count_launches
    from pagedllm.engine import factory

    # The CUDA backend's choices (Triton attention; the layer ops asked for) on this CPU.
    factory.choose_backend = lambda device: generic_backend("cpu", attention="triton",
                                                            layer_ops=layer_ops)
    llm = LLM(model_path, dtype="float32", device="torch-cpu", max_num_seqs=max(8, n),
              kv_cache_memory=64 << 20, max_model_len=256)
    engine, model = llm.engine, llm.engine.runner.model
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    for i in range(n):
        engine.add_request(None, [(5 + 7 * i + 3 * j) % 40000 + 5 for j in range(16)], params)
    engine.step()  # the prefill
    # Layer 1, not 0: the first layer also makes the step's attention layout (once a step).
    with count_launches({"layer": model.stack.layers[1], "model": model}) as count:
        engine.step()
    layers = len(model.stack.layers)
    per_layer = count.launches("layer")
    in_model = count.launches("model") + per_layer  # layer 1's launches count in "layer" only
    while engine.has_unfinished_requests():
        engine.step()
    del llm
    return {"layer_ops": layer_ops, "concurrency": n, "layers": layers,
            "kernels_per_layer": per_layer,
            "layer_kernels": dict(count.by_scope["layer"].most_common()),
            "kernels_in_model": in_model,
            "kernels_outside_model": count.launches("outside"),
            "outside_kernels": dict(count.by_scope["outside"].most_common()),
            "kernels_per_step": in_model + count.launches("outside")}


def moe_layer_launches(experts: int, top_k: int, layer_ops: str) -> dict:
    """One mixture-of-experts layer at one token (hidden 64, random weights): its grouped
    path (torch layer ops: the host counts each expert's tokens) or its pairs on the device
    (Triton layer ops, models/moe_triton.py)."""
    from pagedllm.backends.launch_count import count_launches
    from pagedllm.backends.torch_layer_ops import TorchLayerOps
    from pagedllm.backends.triton_layer_ops import TritonLayerOps
    from pagedllm.model_config import ModelConfig
    from pagedllm.models.moe import MoE

    config = ModelConfig(architecture="qwen3_moe", vocab_size=10, hidden_size=64,
                         intermediate_size=96, num_layers=1, num_heads=4, num_kv_heads=2,
                         head_dim=16, rms_norm_eps=1e-5, rope_theta=1e4,
                         max_position_embeddings=64, tie_word_embeddings=False,
                         num_experts=experts, num_experts_per_tok=top_k,
                         expert_intermediate_size=48, norm_topk_prob=True)
    layer = MoE(config, {"torch": TorchLayerOps, "triton": TritonLayerOps}[layer_ops])
    with torch.no_grad():
        for param in layer.parameters():
            param.normal_(0, 0.2)
        x = torch.randn(1, 64)
        with count_launches() as count:
            layer(x)
    return {"experts": experts, "top_k": top_k, "layer_ops": layer_ops,
            "launches": count.launches(), "kernels": dict(count.total.most_common())}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="a model file or folder (default: the "
                        "bundled SmolLM2-135M)")
    parser.add_argument("--levels", default="1,8")
    parser.add_argument("--json", default=None)
    add_smoke(parser)
    args = parser.parse_args()
    args.levels = smoke_or(args.levels, "1")
    torch.set_num_threads(max(1, torch.get_num_threads()))
    rows = []
    for n in (int(level) for level in args.levels.split(",")):
        base, fused = (count_step(args.model, ops, n) for ops in ("torch", "triton"))
        rows += [base, fused]
        print(f"N={n}: kernels per layer {base['kernels_per_layer']} (torch layer ops) -> "
              f"{fused['kernels_per_layer']} (Triton), per step {base['kernels_per_step']} -> "
              f"{fused['kernels_per_step']}: {base['kernels_per_step'] / fused['kernels_per_step']:.2f}x"
              f" fewer; the Triton layer's: {fused['layer_kernels']}; outside the model: "
              f"{fused['outside_kernels']}", flush=True)
    for experts, top_k in ((8, 2), (128, 8)):  # Mixtral's and Qwen3-MoE's routing
        grouped, paired = (moe_layer_launches(experts, top_k, ops) for ops in ("torch", "triton"))
        rows += [grouped, paired]
        print(f"an MoE layer, {experts} experts, {top_k} a token, N=1: {grouped['launches']} "
              f"launches (grouped, a host sync) -> {paired['launches']} (pairs on the device)",
              flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
