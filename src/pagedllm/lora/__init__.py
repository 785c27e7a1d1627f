"""LoRA adapters over the served model: read from PEFT folders and llama.cpp GGUF files
(peft_folder.py, gguf_adapter.py) into one fused layout (adapter.py), checked against the base;
held in the batch's slots (slots.py), where one grouped product per projection serves every
adapter of a step (grouped.py)."""
from pagedllm.lora.adapter import AdapterError, LoRAAdapter
from pagedllm.lora.load import load_adapter

__all__ = ["AdapterError", "LoRAAdapter", "load_adapter"]
