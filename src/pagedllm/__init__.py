"""pagedllm: an LLM inference server with continuous batching and a paged KV cache.

`LLM`, `LLMEngine` and the request types load on first use: `import pagedllm.core.scheduler` (or
config, request, kv_cache, fair_queue) must not pull in torch and the model code, so the
core stays plain data that tests and tools use on their own."""
from __future__ import annotations

__all__ = ["LLM", "LLMEngine", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"

_LAZY = {"LLM": "pagedllm.engine.llm", "LLMEngine": "pagedllm.engine.engine",
         "RequestOutput": "pagedllm.core.request", "SamplingParams": "pagedllm.core.request"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'pagedllm' has no attribute {name!r}")
