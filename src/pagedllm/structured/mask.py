"""Applies grammar matchers' token masks to a batch of logits: rows with a grammar get -inf
for every token their grammar does not allow next; rows without are untouched, so requests
with and without grammars share a step."""
from __future__ import annotations

import torch

_BITS = torch.arange(32, dtype=torch.int32)


def apply_grammar_masks(logits: torch.Tensor, matchers: list) -> torch.Tensor:
    """logits [N, vocab]; matchers[i] a GrammarMatcher or None. Changes logits in place."""
    rows = [i for i, m in enumerate(matchers) if m is not None]
    if not rows:
        return logits
    vocab = logits.shape[1]
    words = (vocab + 31) // 32
    bitmask = torch.zeros(len(rows), words, dtype=torch.int32)
    for j, i in enumerate(rows):
        matcher = matchers[i]
        if matcher.failed:  # cannot happen while the mask holds; end the answer cleanly
            allowed = torch.zeros(words * 32, dtype=torch.bool)
            allowed[list(matcher.eos_token_ids)] = True
            bitmask[j] = _pack(allowed)
        else:
            matcher.fill_bitmask(bitmask[j].data_ptr(), words * 4)
    allowed = ((bitmask.unsqueeze(-1) >> _BITS) & 1).view(len(rows), -1)[:, :vocab].bool()
    index = torch.tensor(rows)
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
    return logits


def _pack(allowed: torch.Tensor) -> torch.Tensor:
    bits = allowed.view(-1, 32).to(torch.int64) << _BITS.to(torch.int64)
    packed = bits.sum(dim=1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)
