"""GPU probe (issue 32): where gemma2's float32 logits part from transformers' on the GPU.

The same weights run through the generic torch path on the CPU (where they match
transformers to 1e-6) and on the GPU (where they were 1.5e-3 off, with either attention);
every module's output is recorded in both runs and the modules are printed in the order they
ran with the largest difference each, so the first one to jump is the culprit. Then
transformers' own layers on the GPU against ours, layer by layer. Runs on a CPU-only
machine too (`--device cpu` twice: every difference must be 0), to check the script.
"""
import json
import sys
import tempfile

import torch

from paged_helpers import run_paged
from pagedllm.backends.cpu import generic_backend
from pagedllm.models.build import build_model
from pagedllm.weights import load_checkpoint
from tiny_models import tiny_hf_model, write_hf_folder

DEVICE = sys.argv[1] if len(sys.argv) > 1 else "cuda"
SEQ = [7, 3, 9, 200, 15, 15, 16, 80, 81]


def first(value):
    while isinstance(value, (tuple, list)):
        value = value[0]
    return value


def record(model) -> tuple[list, dict]:
    order, outputs = [], {}
    for name, module in model.stack.named_modules():
        def hook(_module, _inputs, output, name=name):
            tensor = first(output)
            if isinstance(tensor, torch.Tensor):
                if name not in outputs:
                    order.append(name)
                outputs.setdefault(name, []).append(tensor.detach().float().cpu().clone())
        module.register_forward_hook(hook)
    return order, outputs


def main() -> None:
    reference = tiny_hf_model("gemma2", seed=3)
    checkpoint = load_checkpoint(write_hf_folder(reference, tempfile.mkdtemp()))
    with torch.no_grad():
        expected = reference(torch.tensor([SEQ])).logits[0]
    runs = {}
    for label, device in (("cpu", "cpu"), ("device", DEVICE)):
        model = build_model(checkpoint.config, checkpoint.weights,
                            backend=generic_backend(device, attention="batched"))
        order, outputs = record(model)
        logits = run_paged(model, [SEQ], device=device)[0]
        runs[label] = (order, outputs, logits)
    order, cpu_outputs, cpu_logits = runs["cpu"]
    _, dev_outputs, dev_logits = runs["device"]
    report = {"logits_cpu_vs_transformers": (cpu_logits - expected).abs().max().item(),
              "logits_device_vs_transformers": (dev_logits - expected).abs().max().item(),
              "modules": []}
    for name in order:
        diffs = [(a - b).abs().max().item() for a, b in zip(cpu_outputs[name], dev_outputs[name])]
        scale = max(a.abs().max().item() for a in cpu_outputs[name])
        report["modules"].append({"module": name, "max_diff": max(diffs), "max_abs": scale})
    # transformers' own decoder layers on the device, against its CPU run (same weights).
    hf_layers = {}
    for device in ("cpu", DEVICE):
        seen = []
        hooks = [layer.register_forward_hook(
            lambda _m, _i, out, seen=seen: seen.append(first(out).detach().float().cpu()))
            for layer in reference.model.layers]
        with torch.no_grad():
            reference.to(device)(torch.tensor([SEQ], device=device))
        for hook in hooks:
            hook.remove()
        hf_layers[device] = seen
    report["transformers_layers_device_vs_cpu"] = [
        (a - b).abs().max().item() for a, b in zip(hf_layers["cpu"], hf_layers[DEVICE])]
    print(json.dumps({k: v for k, v in report.items() if k != "modules"}))
    for row in report["modules"]:
        print(json.dumps(row))


if __name__ == "__main__":
    main()
