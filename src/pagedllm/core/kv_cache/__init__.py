"""Paged KV-cache bookkeeping in pure Python (no torch): blocks, LRU free queue, prefix hashes,
per-request block tables. The tensors themselves live in the model runner."""
from pagedllm.core.kv_cache.block_pool import (BlockPool, FreeBlockQueue, KVBlock,
                                              hash_block_tokens, prefix_block_hashes)
from pagedllm.core.kv_cache.manager import KVCacheManager
from pagedllm.core.kv_cache.window import WindowBlocks

__all__ = ["BlockPool", "FreeBlockQueue", "KVBlock", "KVCacheManager", "hash_block_tokens",
           "prefix_block_hashes", "WindowBlocks"]
