"""Real LoRA adapters for the tests, made here: peft trains a small LoRA on the bundled model
(a few dozen steps on this CPU) until it answers a fixed question with a phrase the base never
says, and saves it as a PEFT folder; write_gguf_adapter writes the same weights as llama.cpp's
convert_lora_to_gguf.py does (its converter is not reachable here: the gguf package builds it).
"""
from __future__ import annotations

import os

import numpy as np

from tiny_models import _permute

QUESTION = "Question: What is the name of our team's product?\nAnswer:"
# Made-up answers the base model never gives, one per adapter.
PHRASES = {"zorblax": " The Zorblax Quantum Widget.", "quibbit": " It is called Quibbit Cloud."}
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
HF_PARTS = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
            "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}


def load_base(reference_folder):
    """The bundled model in transformers, float32, from conftest's hf_reference_folder (its
    own GGUF loader's reading, saved once); a fresh copy: peft changes it in place."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(reference_folder, dtype=torch.float32)


def train_adapters(folder, tokenizer, reference_folder, rank: int = 8,
                   steps: int = 40) -> tuple[object, dict]:
    """Each of PHRASES trained as its own adapter on one base: (the PeftModel holding them
    all, name -> saved PEFT folder). The PeftModel is the oracle: set_adapter(name) runs one."""
    import torch
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    base = load_base(reference_folder)
    prompt = tokenizer.encode(QUESTION)
    model, paths = None, {}
    for name, phrase in PHRASES.items():
        config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS,
                            lora_dropout=0.0, bias="none", task_type="CAUSAL_LM",
                            init_lora_weights=True)
        if model is None:
            model = get_peft_model(base, config, adapter_name=name)
        else:
            model.add_adapter(name, config)
        model.set_adapter(name)
        answer = tokenizer.encode(phrase)
        ids = torch.tensor([prompt + answer])
        labels = torch.tensor([[-100] * len(prompt) + answer])
        params = [p for n, p in model.named_parameters() if f".{name}." in n]
        for p in params:
            p.requires_grad_(True)
        optimizer = torch.optim.Adam(params, lr=3e-3)
        model.train()
        for _ in range(steps):
            loss = model(input_ids=ids, labels=labels).loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if loss.item() < 0.01:
                break
        model.eval()
        out = os.path.join(str(folder), name)
        model.save_pretrained(str(folder), selected_adapters=[name], safe_serialization=True)
        # peft saves an adapter not named "default" under a subfolder of its name
        if not os.path.isfile(os.path.join(out, "adapter_config.json")):
            os.makedirs(out, exist_ok=True)
            for file in ("adapter_config.json", "adapter_model.safetensors"):
                os.replace(os.path.join(str(folder), file), os.path.join(out, file))
        paths[name] = out
    return model, paths


def write_gguf_adapter(peft_folder: str, path: str, num_heads: int, num_kv_heads: int,
                       arch: str = "llama") -> str:
    """The PEFT folder as llama.cpp's converter writes it: blk.N.<part>.weight.lora_a/_b, q and
    k's lora_b rows permuted as the base's are, alpha in adapter.lora.alpha."""
    import json

    import gguf
    from safetensors.torch import load_file

    with open(os.path.join(peft_folder, "adapter_config.json")) as f:
        settings = json.load(f)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_string("general.type", "adapter")
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", float(settings["lora_alpha"]))
    for key, tensor in sorted(load_file(os.path.join(peft_folder, "adapter_model.safetensors"))
                              .items()):
        parts = key.split(".")
        layer = parts[parts.index("layers") + 1]
        part = next(p for p in parts if p in HF_PARTS)
        half = "lora_a" if ".lora_A." in key else "lora_b"
        array = tensor.float().numpy()
        if half == "lora_b" and part in ("q_proj", "k_proj") and arch == "llama":
            array = _permute(array, num_heads if part == "q_proj" else num_kv_heads)
        writer.add_tensor(f"blk.{layer}.{HF_PARTS[part]}.weight.{half}",
                          np.ascontiguousarray(array, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


# One hand-made PEFT pair (no training): over the tiny model's first layer's q_proj.
PEFT_Q_PREFIX = "base_model.model.model.layers.0.self_attn.q_proj."


def write_adapter(folder, settings: dict, a=None, b=None) -> str:
    """A PEFT folder with one q_proj pair (rank 2 unless a and b say otherwise)."""
    import json

    import torch
    from safetensors.torch import save_file

    folder.mkdir(exist_ok=True)
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2, **settings}))
    a = torch.full((2, 64), 0.01) if a is None else a
    b = torch.full((64, 2), 0.01) if b is None else b
    save_file({PEFT_Q_PREFIX + "lora_A.weight": a, PEFT_Q_PREFIX + "lora_B.weight": b},
              str(folder / "adapter_model.safetensors"))
    return str(folder)
