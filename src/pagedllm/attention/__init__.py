from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.torch_reference import TorchReferenceBackend

__all__ = ["AttentionMetadata", "TorchReferenceBackend"]
