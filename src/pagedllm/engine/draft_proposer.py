"""Proposals from a draft model (`--speculative draft --draft-model PATH`): a smaller model of
the same tokenizer guesses the next k tokens greedily, and the served model verifies them in
one step (core/speculation.py, engine/verify.py).

The draft model keeps its own small paged KV cache: its own pool and block tables
(a KVCacheManager without prefix caching), so nothing of the served model's bookkeeping
changes. Per request it remembers which tokens its cache holds; after a verification the
part that matches the request's tokens stays (the accepted proposals), the rest is given
back, and the next proposal first feeds what the draft has not seen (the whole prompt the
first time, then the served model's own token) and then decodes k - 1 more, all requests in
one batch. Proposals are greedy, single tokens: the verification keeps the output exactly
what the served model alone gives, greedy or sampled (engine/verify.py says why).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagedllm.attention import AttentionMetadata, allocate_layer_caches
from pagedllm.core.kv_cache import KVCacheManager
from pagedllm.core.request import Request, SamplingParams
from pagedllm.engine.sampler import apply_logit_bias


@dataclass
class DraftSequence:
    """What the draft cache holds of one request: `tokens` at positions 0.. (KVCacheManager
    reads num_computed_tokens, their number); the first num_real were the request's own
    tokens when fed, the rest its proposals, which hold only where they were accepted."""

    request_id: str
    num_preemptions: int
    tokens: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_real: int = 0
    params: SamplingParams | None = None  # the request's: its logit_bias moves proposals too


class DraftProposer:
    def __init__(self, model, num_blocks: int, block_size: int, dtype: torch.dtype,
                 max_positions: int, max_chunk: int, kv_cache_dtype: str = "auto"):
        """max_chunk: most tokens fed for one request in one proposal (a long prompt is fed
        over several steps, with no proposal until it is in)."""
        config = model.config
        self.model, self.block_size = model, block_size
        self.max_positions, self.max_chunk = max_positions, max_chunk
        self.kv = KVCacheManager(num_blocks, block_size, enable_caching=False)
        self.kv_caches = allocate_layer_caches(config.num_layers, num_blocks, block_size,
                                               config.num_kv_heads, config.head_dim, dtype,
                                               kv_cache_dtype)
        self.sequences: dict[str, DraftSequence] = {}

    def forget(self, request_id: str) -> None:
        seq = self.sequences.pop(request_id, None)
        if seq is not None:
            self.kv.free(seq)

    def propose(self, wanted: list[tuple[Request, int]]) -> dict[str, list[int]]:
        """Up to k greedy draft tokens for each (request, k); fewer, or none, where the draft's
        pool, its context or the chunk limit stops it."""
        feeds = []  # (seq, tokens to feed, k)
        for request, k in wanted:
            seq = self._sync(request)
            start = seq.num_computed_tokens
            chunk = request.all_token_ids[start:request.num_tokens]
            if len(chunk) > self.max_chunk:
                chunk, k = chunk[:self.max_chunk], 0  # catch up first, propose next time
            k = min(k, self.max_positions - request.num_tokens)
            if not self._grow(seq, chunk):
                continue
            feeds.append((seq, chunk, k))
        proposals: dict[str, list[int]] = {seq.request_id: [] for seq, _, _ in feeds}
        live = [(seq, chunk) for seq, chunk, k in feeds]
        for seq, chunk in live:
            seq.num_real += len(chunk)
        ks = {seq.request_id: k for seq, _, k in feeds}
        while live:
            tokens = self._forward(live)
            live = []
            for seq, token in tokens:
                drafts = proposals[seq.request_id]
                if len(drafts) >= ks[seq.request_id]:
                    continue
                drafts.append(token)
                # The last proposal is never fed: its KV would be computed by the served model.
                if len(drafts) < ks[seq.request_id] and self._grow(seq, [token]):
                    live.append((seq, [token]))
        return proposals

    def _sync(self, request: Request) -> DraftSequence:
        """The request's draft sequence, keeping only the cached tokens that still match."""
        seq = self.sequences.get(request.request_id)
        if seq is not None and seq.num_preemptions != request.num_preemptions:
            self.forget(request.request_id)  # its blocks went with the served model's
            seq = None
        if seq is None:
            seq = self.sequences[request.request_id] = DraftSequence(
                request.request_id, request.num_preemptions)
        # Proposals fed after the real tokens hold where verification accepted them. The
        # request's last token is always fed again: its logits give the first proposal.
        tokens, valid = request.all_token_ids, seq.num_real
        limit = min(len(seq.tokens), request.num_tokens - 1)
        while valid < limit and seq.tokens[valid] == tokens[valid]:
            valid += 1
        seq.num_computed_tokens = seq.num_real = valid
        seq.params = request.params
        del seq.tokens[valid:]
        self.kv.trim(seq)
        return seq

    def _grow(self, seq: DraftSequence, tokens: list[int]) -> bool:
        """Slots for `tokens` after what the sequence holds; False (the request's draft state
        dropped) when the draft's pool is full."""
        if self.kv.allocate_slots(seq, len(tokens)):
            return True
        self.forget(seq.request_id)
        return False

    def _forward(self, feeds: list[tuple[DraftSequence, list[int]]]) -> list[tuple[DraftSequence, int]]:
        """Feed each sequence its tokens (one batch); each one's greedy next token."""
        bs = self.block_size
        input_ids, positions, slots, starts, seq_lens, tables = [], [], [], [0], [], []
        for seq, tokens in feeds:
            table = self.kv.block_table(seq.request_id)
            first = seq.num_computed_tokens
            input_ids += tokens
            positions += range(first, first + len(tokens))
            slots += [table[p // bs] * bs + p % bs for p in range(first, first + len(tokens))]
            starts.append(starts[-1] + len(tokens))
            seq_lens.append(first + len(tokens))
            tables.append(table)
            seq.tokens += tokens
            seq.num_computed_tokens += len(tokens)
        meta = AttentionMetadata.build(slots, starts, seq_lens, tables, bs)
        hidden = self.model(torch.tensor(input_ids, dtype=torch.long),
                            torch.tensor(positions, dtype=torch.long), self.kv_caches, meta)
        logits = self.model.compute_logits(hidden[[end - 1 for end in starts[1:]]])
        seqs = [seq for seq, _ in feeds]
        # A request's logit_bias moves what it samples, so it moves what to propose (the
        # sampler's own step; a copy, the model's output being an inference tensor).
        if any(seq.params.logit_bias for seq in seqs):
            logits = apply_logit_bias(logits.clone(), seqs)
        return list(zip(seqs, logits.argmax(dim=-1).tolist()))
