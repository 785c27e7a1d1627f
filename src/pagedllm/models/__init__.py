from pagedllm.models.llama import LlamaForCausalLM

__all__ = ["LlamaForCausalLM"]
