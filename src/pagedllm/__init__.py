"""pagedllm: an LLM inference server with continuous batching and a paged KV cache."""
from pagedllm.engine import LLM, LLMEngine
from pagedllm.request import RequestOutput, SamplingParams

__all__ = ["LLM", "LLMEngine", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"
