"""Fixed-size KV blocks, their reference counts and the LRU queue of free blocks.

A free block keeps its content hash, so a later request with the same prefix can take it
back (a prefix-cache hit); its hash is dropped only when the block is reused for new
content (lazy eviction). The free queue is a doubly linked list threaded through the blocks
themselves, so taking a cached block out of the middle is O(1).
"""
from __future__ import annotations

import hashlib
from array import array
from collections.abc import Iterable, Sequence

BlockHash = bytes


def hash_block_tokens(parent_hash: BlockHash | None, token_ids: Sequence[int],
                      extra_key: str | None = None) -> BlockHash:
    """A full block's identity: its tokens, everything before it (through the parent's hash),
    and an optional extra key (a tenant salt). sha256, so hashes cannot be made to collide."""
    digest = hashlib.sha256(parent_hash or b"\0" * 32)
    digest.update(array("q", token_ids).tobytes())
    if extra_key:
        digest.update(b"\xff" + extra_key.encode())
    return digest.digest()


def prefix_block_hashes(token_ids: Sequence[int], block_size: int,
                        extra_key: str | None = None) -> list[BlockHash]:
    """The hash chain of every full block of token_ids: the keys the prefix cache finds
    them under (the replicas' router predicts cache hits with it)."""
    hashes: list[BlockHash] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        hashes.append(hash_block_tokens(hashes[-1] if hashes else None,
                                        token_ids[start:start + block_size], extra_key))
    return hashes


class KVBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.prev_free: KVBlock | None = None
        self.next_free: KVBlock | None = None

    def __repr__(self) -> str:
        return f"KVBlock({self.block_id}, ref={self.ref_cnt}, cached={self.block_hash is not None})"


class FreeBlockQueue:
    """Free blocks in eviction order: the head is reused first (least recently freed)."""

    def __init__(self, blocks: Iterable[KVBlock]):
        self._head = KVBlock(-1)  # sentinels keep insert/remove branch-free
        self._tail = KVBlock(-1)
        self._head.next_free, self._tail.prev_free = self._tail, self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def append(self, block: KVBlock) -> None:
        self._insert_after(self._tail.prev_free, block)

    def appendleft(self, block: KVBlock) -> None:
        self._insert_after(self._head, block)

    def _insert_after(self, prev: KVBlock, block: KVBlock) -> None:
        nxt = prev.next_free
        prev.next_free, block.prev_free = block, prev
        block.next_free, nxt.prev_free = nxt, block
        self.num_free_blocks += 1

    def remove(self, block: KVBlock) -> None:
        if block.prev_free is None or block.next_free is None:
            raise ValueError(f"{block} is not in the free queue")
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def popleft(self) -> KVBlock:
        first = self._head.next_free
        if first is self._tail:
            raise ValueError("no free blocks")
        self.remove(first)
        return first

    def __iter__(self):
        block = self._head.next_free
        while block is not self._tail:
            yield block
            block = block.next_free

    def __len__(self) -> int:
        return self.num_free_blocks


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached_blocks: dict[BlockHash, KVBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.free_queue.num_free_blocks

    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVBlock | None:
        return self.cached_blocks.get(block_hash)

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on cached blocks (a prefix hit), pulling free ones off the queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def allocate(self, num_blocks: int) -> list[KVBlock]:
        if num_blocks > self.num_free_blocks:
            raise ValueError(f"asked for {num_blocks} blocks, {self.num_free_blocks} free")
        blocks = []
        for _ in range(num_blocks):
            block = self.free_queue.popleft()
            self._evict(block)
            block.ref_cnt = 1
            blocks.append(block)
        return blocks

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            if self.cached_blocks.get(block.block_hash) is block:
                del self.cached_blocks[block.block_hash]
            block.block_hash = None

    def cache_block(self, block: KVBlock, block_hash: BlockHash) -> None:
        """Register a full block's content; a hash already cached keeps its first block."""
        if not self.enable_caching or block.block_hash is not None:
            return
        block.block_hash = block_hash
        self.cached_blocks.setdefault(block_hash, block)

    def free(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference from each block; callers pass a request's blocks in reverse
        order, so its tail blocks are evicted before the prefix others may share. Blocks
        without cached content go to the front of the queue, cached ones to the back."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise ValueError(f"{block} freed more times than taken")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    # Nothing worth keeping: reuse it first, before untouched blocks, so
                    # resident memory tracks the working set rather than the pool size.
                    self.free_queue.appendleft(block)
                else:
                    self.free_queue.append(block)  # LRU: cached content evicted last

    def reset_prefix_cache(self) -> None:
        for block in self.cached_blocks.values():
            block.block_hash = None
        self.cached_blocks.clear()
