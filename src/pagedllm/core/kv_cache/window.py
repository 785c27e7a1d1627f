"""The KV blocks of sliding-window layers (Gemma 2 and 3's local layers), apart from the rest.

A query at position p in such a layer sees keys at p - window + 1 .. p only, so a request
needs these layers' blocks for the last `window` tokens and the ones it is computing, never
more: blocks that have slid out of the window are returned to this group's own pool as the
request goes on (as vLLM's sliding-window manager does), and their table entries point at a
null block that no query reads. A long conversation holds a constant number of these
blocks, while the full-attention layers' blocks (KVCacheManager) grow with it.

Pure Python, like the rest of the bookkeeping; the caller passes the block hashes (the same
chain as the full-attention blocks: the same tokens), so prefix caching covers these blocks
too. A prefix hit needs only the blocks its first new query sees.
"""
from __future__ import annotations

from pagedllm.core.kv_cache.block_pool import BlockHash, BlockPool, KVBlock
from pagedllm.core.sizing import blocks_for_tokens


class WindowBlocks:
    def __init__(self, num_blocks: int, block_size: int, window: int, enable_caching: bool = True):
        if window < 1:
            raise ValueError(f"window must be at least 1, got {window}")
        self.pool = BlockPool(num_blocks, enable_caching)
        self.block_size, self.window = block_size, window
        # Freed entries of a table point here: one block past the pool, which the runner
        # allocates and zeroes and nothing ever writes.
        self.null_block_id = num_blocks
        self.tables: dict[str, list[KVBlock | None]] = {}
        self._num_cached: dict[str, int] = {}

    def first_visible_block(self, position: int) -> int:
        """The first block a query at `position` reads (keys after position - window)."""
        return max(0, position - self.window + 1) // self.block_size

    def table(self, request_id: str) -> list[int]:
        return [self.null_block_id if b is None else b.block_id
                for b in self.tables.get(request_id, ())]

    def num_held(self, request_id: str) -> int:
        return sum(b is not None for b in self.tables.get(request_id, ()))

    def hit(self, hashes: list[BlockHash]) -> tuple[int, list[KVBlock | None]]:
        """The longest prefix of the hashed full blocks whose first uncomputed query finds
        every block it reads cached here: (number of blocks m, the table for them, None
        before the window). m = 0 is always a hit."""
        cached = [self.pool.get_cached_block(h) for h in hashes]
        for m in range(len(hashes), 0, -1):
            first = self.first_visible_block(m * self.block_size)
            if all(b is not None for b in cached[first:m]):
                return m, [None] * first + cached[first:m]
        return 0, []

    def release_slid_out(self, request_id: str, first_query: int) -> None:
        """Give back the request's blocks that no query from first_query on can read."""
        table = self.tables.get(request_id)
        if not table:
            return
        end = min(self.first_visible_block(first_query), len(table))
        # Tail first among them, as KVCacheManager.free does: the prefix others share goes last.
        for i in range(end - 1, -1, -1):
            if table[i] is not None:
                self.pool.free([table[i]])
                table[i] = None

    def can_allocate(self, request_id: str, first_query: int, total_tokens: int,
                     hit: list[KVBlock | None]) -> bool:
        """Whether the pool has the blocks for positions first_query's window .. total_tokens
        (after release_slid_out, which the caller runs first)."""
        have = max(len(self.tables.get(request_id, ())) + len(hit),
                   self.first_visible_block(first_query))
        needed = blocks_for_tokens(total_tokens, self.block_size) - have
        evictable_hits = sum(1 for b in hit if b is not None and b.ref_cnt == 0)
        return needed <= self.pool.num_free_blocks - evictable_hits

    def allocate(self, request_id: str, first_query: int, total_tokens: int,
                 hit: list[KVBlock | None], hashes: list[BlockHash], known_tokens: int) -> None:
        """Blocks for positions up to total_tokens (the caller checked can_allocate); hit
        blocks first, with a reference taken on each; then the full blocks registered under
        `hashes` (which cover the request's known tokens)."""
        table = self.tables.setdefault(request_id, [])
        self.pool.touch([b for b in hit if b is not None])
        table.extend(hit)
        # New blocks before the first visible one (a hit shorter than the window: none).
        skip = max(0, self.first_visible_block(first_query) - len(table))
        table.extend([None] * skip)
        missing = blocks_for_tokens(total_tokens, self.block_size) - len(table)
        if missing > 0:
            table.extend(self.pool.allocate(missing))
        num_full = min(total_tokens, known_tokens) // self.block_size
        for i in range(self._num_cached.get(request_id, 0), num_full):
            if table[i] is not None:
                self.pool.cache_block(table[i], hashes[i])
        self._num_cached[request_id] = max(num_full, self._num_cached.get(request_id, 0))

    def trim(self, request_id: str, num_blocks: int) -> None:
        """Give back the request's blocks past its first num_blocks (rejected proposals')."""
        table = self.tables.get(request_id)
        if table is None or len(table) <= num_blocks:
            return
        extra = table[num_blocks:]
        del table[num_blocks:]
        self.pool.free(b for b in reversed(extra) if b is not None)

    def free(self, request_id: str) -> None:
        table = self.tables.pop(request_id, [])
        self.pool.free(b for b in reversed(table) if b is not None)
        self._num_cached.pop(request_id, None)
