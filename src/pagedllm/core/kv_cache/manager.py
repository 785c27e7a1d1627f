"""Per-request block tables over a BlockPool, with prefix-cache lookup.

A request's table grows as its tokens are scheduled: nothing is reserved for the maximum
length, and only the last block is ever partly empty. Full blocks are hashed (chained with
the parent's hash and the request's cache salt) and registered for reuse.

A model with sliding-window layers next to full-attention ones (Gemma 2 and 3) keeps the
window layers' blocks apart (`window`, a WindowBlocks): every call here covers both groups,
and a step gets blocks only when both can supply them.
"""
from __future__ import annotations

from pagedllm.core.kv_cache.block_pool import BlockHash, BlockPool, KVBlock, hash_block_tokens
from pagedllm.core.kv_cache.window import WindowBlocks
from pagedllm.core.request import Request
from pagedllm.core.sizing import blocks_for_tokens


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 window: WindowBlocks | None = None):
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.window = window
        self.req_blocks: dict[str, list[KVBlock]] = {}
        # Each request's table as block ids, made when its blocks change (every block_size
        # tokens while it decodes), not every step: the plan carries this very tuple, and the
        # model runner rewrites its row of the batch's tables only when the tuple is a new one
        # (engine/block_table_rows.py).
        self._tables: dict[str, tuple[int, ...]] = {}
        self._req_hashes: dict[str, list[BlockHash]] = {}
        self._num_cached_blocks: dict[str, int] = {}  # blocks of the request registered so far
        # The window group's share of the last prefix hit found, by request: get_computed_blocks
        # finds it, allocate_slots takes it.
        self._window_hits: dict[str, list[KVBlock | None]] = {}

    # -- queries ----------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def usage(self) -> float:
        return self.pool.usage()

    def block_table(self, request_id: str) -> tuple[int, ...]:
        table = self._tables.get(request_id)
        if table is None:
            blocks = self.req_blocks.get(request_id)
            if blocks is None:  # no table (never allocated, or freed): nothing kept for it
                return ()
            table = self._tables[request_id] = tuple(b.block_id for b in blocks)
        return table

    def window_block_table(self, request_id: str) -> list[int] | None:
        """The request's table in the window layers' blocks (None: the model has none)."""
        return None if self.window is None else self.window.table(request_id)

    def blocks_needed(self, num_tokens: int) -> int:
        return blocks_for_tokens(num_tokens, self.block_size)

    def _block_hashes(self, request: Request, num_full_blocks: int) -> list[BlockHash]:
        """Hashes of the request's first num_full_blocks blocks, extended lazily and memoised."""
        hashes = self._req_hashes.setdefault(request.request_id, [])
        tokens = request.all_token_ids
        while len(hashes) < num_full_blocks:
            start = len(hashes) * self.block_size
            parent = hashes[-1] if hashes else None
            hashes.append(hash_block_tokens(parent, tokens[start:start + self.block_size],
                                            request.prefix_cache_key))
        return hashes

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """The longest cached prefix of the request, as (blocks, number of tokens).

        A hit never covers the last known token: it must be computed to get logits."""
        if not self.enable_caching:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        hashes = self._block_hashes(request, max_blocks)
        blocks = []
        for block_hash in hashes:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            blocks.append(block)
        if self.window is not None:
            num_hit, window_hit = self.window.hit(hashes[:len(blocks)])
            blocks = blocks[:num_hit]
            self._window_hits[request.request_id] = window_hit
        return blocks, len(blocks) * self.block_size

    # -- changes ----------------------------------------------------------------------------
    def allocate_slots(self, request: Request, num_new_tokens: int,
                       computed_blocks: list[KVBlock] | None = None) -> bool:
        """Make room for num_new_tokens more tokens after the request's computed ones (plus
        any prefix-hit blocks, which it takes a reference on). False, changing nothing, when
        the pool cannot supply the blocks."""
        computed_blocks = computed_blocks or []
        rid = request.request_id
        blocks = self.req_blocks.setdefault(rid, [])
        num_computed = request.num_computed_tokens + len(computed_blocks) * self.block_size
        total_tokens = num_computed + num_new_tokens
        num_new_blocks = self.blocks_needed(total_tokens) - len(blocks) - len(computed_blocks)
        # Cached hits sitting in the free queue stop being free once we take them.
        num_evictable_hits = sum(1 for b in computed_blocks if b.ref_cnt == 0)
        window_hit = self._window_hits.pop(rid, [])
        window_hit = window_hit if computed_blocks else []
        if self.window is not None:  # what slid out goes back first: it is never read again
            self.window.release_slid_out(rid, num_computed)
        if (num_new_blocks > self.pool.num_free_blocks - num_evictable_hits
                or (self.window is not None
                    and not self.window.can_allocate(rid, num_computed, total_tokens, window_hit))):
            if not blocks:
                del self.req_blocks[rid]
            return False
        self.pool.touch(computed_blocks)
        blocks.extend(computed_blocks)
        if num_new_blocks > 0:
            blocks.extend(self.pool.allocate(num_new_blocks))
        if computed_blocks or num_new_blocks > 0:
            self._tables.pop(rid, None)
        self._cache_full_blocks(request, blocks, total_tokens)
        if self.window is not None:
            num_full = min(total_tokens, request.num_tokens) // self.block_size
            hashes = self._block_hashes(request, num_full) if self.enable_caching else []
            self.window.allocate(rid, num_computed, total_tokens, window_hit, hashes,
                                 request.num_tokens if self.enable_caching else 0)
        return True

    def _cache_full_blocks(self, request: Request, blocks: list[KVBlock], num_tokens: int) -> None:
        """Register blocks that this step fills completely (their tokens are all known)."""
        if not self.enable_caching:
            return
        num_full = min(num_tokens, request.num_tokens) // self.block_size
        start = self._num_cached_blocks.get(request.request_id, 0)
        if num_full <= start:
            return
        hashes = self._block_hashes(request, num_full)
        for i in range(start, num_full):
            self.pool.cache_block(blocks[i], hashes[i])
        self._num_cached_blocks[request.request_id] = num_full

    def trim(self, request: Request) -> None:
        """Give back the blocks past the request's computed tokens: the slots of proposed
        tokens that verification rejected (core/speculation.py). None of them is in the prefix
        cache: only blocks of known tokens are registered, and these hold none."""
        keep = self.blocks_needed(request.num_computed_tokens)
        blocks = self.req_blocks.get(request.request_id, [])
        if len(blocks) > keep:
            extra = blocks[keep:]
            del blocks[keep:]
            self._tables.pop(request.request_id, None)
            self.pool.free(reversed(extra))
        if self.window is not None:
            self.window.trim(request.request_id, keep)

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first, and forget its table."""
        blocks = self.req_blocks.pop(request.request_id, [])
        self._tables.pop(request.request_id, None)
        self.pool.free(reversed(blocks))
        if self.window is not None:
            self.window.free(request.request_id)
        self._window_hits.pop(request.request_id, None)
        self._num_cached_blocks.pop(request.request_id, None)
        self._req_hashes.pop(request.request_id, None)
