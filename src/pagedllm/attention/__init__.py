from pagedllm.attention.batched import BatchedBackend
from pagedllm.attention.layer_cache import LayerKVCache, allocate_layer_caches
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.torch_reference import TorchReferenceBackend

BACKENDS = {"batched": BatchedBackend, "torch-reference": TorchReferenceBackend}

__all__ = ["AttentionMetadata", "BACKENDS", "BatchedBackend", "LayerKVCache", "TorchReferenceBackend",
           "allocate_layer_caches"]
