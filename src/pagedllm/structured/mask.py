"""Applies grammar matchers' token masks to a batch of logits: rows with a grammar get -inf
for every token their grammar does not allow next; rows without are untouched, so requests
with and without grammars share a step."""
from __future__ import annotations

import torch

from pagedllm.backends.host_values import to_device
from pagedllm.structured.compiler import fill_bitmasks

# Byte value -> its 8 bits, lowest first, True where the token is NOT allowed: a bitmask read
# as bytes (little-endian, so token t is bit t % 8 of byte t // 8) unpacks by one lookup.
_FORBIDDEN_BY_BYTE = ((torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1) == 0


def apply_grammar_masks(logits: torch.Tensor, matchers: list) -> torch.Tensor:
    """logits [N, vocab]; matchers[i] a GrammarMatcher or None. Changes logits in place."""
    rows = [i for i, m in enumerate(matchers) if m is not None]
    if not rows:
        return logits
    vocab = logits.shape[1]
    words = (vocab + 31) // 32
    bitmask = torch.zeros(len(rows), words, dtype=torch.int32)
    fill_bitmasks([matchers[i] for i in rows], bitmask.data_ptr(), words * 4)
    forbidden = _FORBIDDEN_BY_BYTE[bitmask.view(torch.uint8).long()].view(len(rows), -1)
    # (non_blocking: a blocking copy to a GPU waits for the work queued before it)
    forbidden = forbidden[:, :vocab].to(logits.device, non_blocking=True)
    if len(rows) == logits.shape[0]:
        logits.masked_fill_(forbidden, float("-inf"))
    else:
        index = to_device(rows, torch.long, logits.device)
        logits[index] = logits[index].masked_fill(forbidden, float("-inf"))
    return logits
