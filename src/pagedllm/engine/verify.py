"""Verifying proposed tokens (speculative decoding, core/speculation.py): which sampled tokens
a request keeps after a step that computed its last token and k proposals x_1..x_k.

Row j (0..k) of such a request holds the model's distribution p_j for the token after x_j,
given the request's tokens and x_1..x_j. Each row is sampled as a plain decode step would
sample it (the same sampler: temperature, top-k/p, min-p, penalties over the output as if
x_1..x_j were accepted), giving t_j. The request keeps t_0, then t_1 if t_0 = x_1, then t_2
if also t_1 = x_2, and so on: t_0..t_m where m is the first j with t_j != x_{j+1} (or k).

Greedy: t_j is the argmax, so the kept tokens are exactly the ones one-at-a-time greedy
decoding gives. Sampling: proposals here are single tokens, not distributions (q puts all
its mass on x_j), and for such a proposal this *is* the standard rejection sampling of
speculative decoding (Leviathan et al. 2023; Chen et al. 2023): x_j is accepted with
probability min(1, p(x_j) / q(x_j)) = p(x_j), which is the chance that t_j = x_j; when it is
rejected, the token comes from the residual max(0, p - q) renormalised, which is p without
x_j, and t_j given t_j != x_j is distributed exactly so. Every kept token therefore has the
distribution plain sampling gives it (tests/test_speculative_engine.py checks it by counting).
"""
from __future__ import annotations

import dataclasses

from pagedllm.core.request import TokenLogprob
from pagedllm.core.step_records import SampledToken
from pagedllm.engine.sampler import SamplingRow


def verification_rows(request_ids: list[str], sequences: dict[str, SamplingRow],
                      drafts: dict[str, tuple[int, ...]], vocab_size: int) -> list[SamplingRow]:
    """The sampling row of each logits row: a verifying request's j-th row sees its output
    extended by its first j proposals (for the penalties), shares its random stream, and,
    under a grammar, samples under the grammar's mask after those proposals (past the first
    proposal the grammar refuses, under the mask before it: those rows are never kept)."""
    rows, seen, masks = [], {}, {}
    row_bytes = (vocab_size + 31) // 32 * 4
    for rid in request_ids:
        row = sequences[rid]
        j = seen[rid] = seen.get(rid, -1) + 1
        if j == 0:
            rows.append(row)
            continue
        grammar = row.grammar
        if grammar is not None:
            if rid not in masks:
                masks[rid] = grammar.masks_along(list(drafts[rid]), row_bytes)
            along = masks[rid]
            grammar = along[min(j, len(along)) - 1] if along else grammar
        rows.append(dataclasses.replace(
            row, output_token_ids=row.output_token_ids + list(drafts[rid][:j]), grammar=grammar))
    return rows


def accepted_tokens(request_ids: list[str], tokens: list[int],
                    logprobs: list[TokenLogprob | None],
                    drafts: dict[str, tuple[int, ...]]) -> dict[str, list[SampledToken]]:
    """Each request's kept tokens, in order, from its rows' samples (a request's rows are
    consecutive and in position order)."""
    kept: dict[str, list[SampledToken]] = {}
    open_: dict[str, bool] = {}  # whether every sample so far equalled the proposal it was fed
    for rid, token, logprob in zip(request_ids, tokens, logprobs):
        if not open_.get(rid, rid not in kept):
            continue
        sampled = kept.setdefault(rid, [])
        j = len(sampled)
        sampled.append(SampledToken(token, logprob))
        proposals = drafts.get(rid, ())
        open_[rid] = j < len(proposals) and token == proposals[j]
    return kept
