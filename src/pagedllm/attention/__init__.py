from pagedllm.attention.batched import BatchedBackend
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.torch_reference import TorchReferenceBackend

BACKENDS = {"batched": BatchedBackend, "torch-reference": TorchReferenceBackend}

__all__ = ["AttentionMetadata", "BACKENDS", "BatchedBackend", "TorchReferenceBackend"]
