"""Next-token sampling for a batch of rows with per-row parameters.

Order (as in vLLM): logit_bias -> grammar masks (structured output) -> penalties -> greedy
rows take the argmax -> temperature ->
top-k / top-p / min-p masks -> sample. Sampling inverts the cumulative distribution at one
uniform draw from the row's own generator when seeded, so a seed gives the same tokens
whatever else is in the batch. Logprobs are of the raw model distribution (before logit_bias, as vLLM reports them).

A grammar row that is greedy or samples at a plain temperature (no top-k/top-p/min-p) draws
first and asks its grammar afterwards (as llama.cpp does): a token the grammar allows is
kept, and only a refused one costs the full mask and a second draw from the masked logits.
That is exact, not an approximation: the argmax that the grammar allows is the masked argmax,
and a draw from p kept when it falls in the allowed set A, else redrawn from p restricted to
A, gives every t in A the probability p(t) + (1 - p(A)) p(t) / p(A) = p(t) / p(A). Truncated
rows are masked first, since top-p of the masked distribution is not top-p of p.

Where the logits are on a GPU, a draw never waits for them (`sync_free`): with overlapped
steps (engine/overlap.py) the host plans the next step while the device computes, and a
read of a device value would make it wait for the step to finish. So there every grammar
row is masked first (asking its grammar about a drawn token means reading the token), a
truncated row whose kept set may run past the top-1024 candidates is answered by the full
sort whether or not it does (deciding which rows do is a read), and the host's values
(temperatures, uniform draws, ids) travel in copies that do not wait. On a CPU nothing
waits for anything and the cheaper branches are taken.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pagedllm.backends.host_values import to_device
from pagedllm.core.request import SamplingParams, TokenLogprob
from pagedllm.structured.mask import apply_grammar_masks

if TYPE_CHECKING:
    from pagedllm.structured.compiler import GrammarMatcher


@dataclass
class SamplingRow:
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: torch.Generator | None = None
    grammar: GrammarMatcher | None = None  # structured output: its mask applies first


def apply_logit_bias(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Each row's logit_bias added to its tokens' logits (ids checked against the vocabulary
    when the request was made)."""
    for i, row in enumerate(rows):
        bias = row.params.logit_bias
        if bias:
            ids = to_device(list(bias), torch.long, logits.device)
            logits[i, ids] += to_device(list(bias.values()), logits.dtype, logits.device)
    return logits


def apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Repetition penalty over prompt + output tokens; presence / frequency over output only."""
    vocab_size = logits.shape[1]
    for i, row in enumerate(rows):
        p = row.params
        if p.repetition_penalty != 1.0:
            seen = to_device(sorted(set(row.prompt_token_ids) | set(row.output_token_ids)),
                             torch.long, logits.device)
            if seen.numel():
                values = logits[i, seen]
                logits[i, seen] = torch.where(values > 0, values / p.repetition_penalty,
                                              values * p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and row.output_token_ids:
            # (scatter_add, not bincount: bincount on a GPU reads the largest id to size
            # its output, a wait for the device)
            ids = to_device(row.output_token_ids, torch.long, logits.device)
            counts = torch.zeros(vocab_size, dtype=logits.dtype, device=logits.device)
            counts.scatter_add_(0, ids, torch.ones_like(ids, dtype=logits.dtype))
            logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


# Candidates examined before falling back to sorting the whole vocabulary: top-p and min-p
# sets of real distributions are almost always far smaller. Sorting 49,152 logits cost
# 3.5 ms a row here; top-1024 costs ~0.3 ms.
TRUNCATION_CANDIDATES = 1024


def truncation_mask(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                    min_p: torch.Tensor, sync_free: bool = False) -> torch.Tensor:
    """True where a token is kept. top_k [N] (0 = off), top_p [N], min_p [N]; logits already
    divided by temperature. The most likely token is always kept. Top-p mass is counted
    after the top-k cut (renormalised), as in vLLM. sync_free: never read which rows need
    the full sort (every row gets it, and the rows that need it take it)."""
    vocab_size = logits.shape[1]
    num_candidates = min(vocab_size, TRUNCATION_CANDIDATES)
    k = torch.where(top_k > 0, top_k.clamp(max=vocab_size), vocab_size)
    values, order = logits.topk(num_candidates, dim=-1)  # sorted, descending
    in_top_k = torch.arange(num_candidates, device=logits.device).unsqueeze(0) < k.unsqueeze(1)
    # Normaliser of the top-k set: over the candidates when they hold it, else the vocabulary.
    whole = k >= vocab_size
    normaliser = torch.where(
        whole.unsqueeze(1), logits.logsumexp(dim=-1, keepdim=True),
        values.masked_fill(~in_top_k, float("-inf")).logsumexp(dim=-1, keepdim=True))
    probs = (values - normaliser).exp().masked_fill_(~in_top_k, 0.0)
    keep_sorted = _keep_sorted(probs, in_top_k, top_p, min_p)
    keep = torch.zeros_like(logits, dtype=torch.bool).scatter_(1, order, keep_sorted)
    # Rows whose kept set may run past the candidates, or whose top-k set is larger than the
    # candidates but not the whole vocabulary: sort everything.
    unresolved = (k > num_candidates) & (keep_sorted[:, -1] | ~whole)
    if num_candidates < vocab_size and sync_free:
        full = _full_sort_mask(logits, k, top_p, min_p)
        return torch.where(unresolved.unsqueeze(1), full, keep)
    if num_candidates < vocab_size and unresolved.any():
        rows = unresolved.nonzero().squeeze(1)
        keep[rows] = _full_sort_mask(logits[rows], k[rows], top_p[rows], min_p[rows])
    return keep


def _keep_sorted(probs: torch.Tensor, in_top_k: torch.Tensor, top_p: torch.Tensor,
                 min_p: torch.Tensor) -> torch.Tensor:
    """Over descending probabilities: keep a token while the mass before it is below top_p
    and it is at least min_p times the most likely one."""
    mass_before = probs.cumsum(dim=-1) - probs
    keep = in_top_k & (mass_before < top_p.unsqueeze(1))
    keep &= probs >= min_p.unsqueeze(1) * probs[:, :1]
    keep[:, 0] = True
    return keep


def _full_sort_mask(logits: torch.Tensor, k: torch.Tensor, top_p: torch.Tensor,
                    min_p: torch.Tensor) -> torch.Tensor:
    vocab_size = logits.shape[1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    in_top_k = torch.arange(vocab_size, device=logits.device).unsqueeze(0) < k.unsqueeze(1)
    probs = sorted_logits.masked_fill(~in_top_k, float("-inf")).softmax(dim=-1)
    keep_sorted = _keep_sorted(probs, in_top_k, top_p, min_p)
    return torch.empty_like(keep_sorted).scatter_(1, order, keep_sorted)


def sample_from_probs(probs: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Inverse-CDF sampling: one uniform draw per row from the row's own generator (so a seed
    gives the same token whatever else is in the batch). One cumsum over the vocabulary; an
    exponential race drew 49,152 variates per row, 18x slower here (benchmarks/sampler_speed.py)."""
    cdf = probs.cumsum(dim=-1)
    # Drawn on the host (a seeded request's generator lives there), moved in one copy.
    uniform = torch.cat([torch.rand(1, generator=row.generator) for row in rows])
    if probs.device.type != "cpu":
        uniform = uniform.to(probs.device, non_blocking=True)
    targets = (uniform * cdf[:, -1]).unsqueeze(1)
    # First token whose cumulative mass exceeds the draw: zero-probability tokens never are.
    return torch.searchsorted(cdf, targets, right=True).squeeze(1).clamp_(max=probs.shape[1] - 1)


def compute_logprobs(raw_logits: torch.Tensor, token_ids: torch.Tensor, rows: list[SamplingRow]):
    wanted = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    result: list[TokenLogprob | None] = [None] * len(rows)
    if not wanted:
        return result
    logprobs = raw_logits[wanted].log_softmax(dim=-1)
    max_top = max(rows[i].params.logprobs for i in wanted)
    top_values, top_ids = logprobs.topk(max(max_top, 1), dim=-1)
    for j, i in enumerate(wanted):
        n = rows[i].params.logprobs
        chosen = int(token_ids[i])
        result[i] = TokenLogprob(
            token_id=chosen, logprob=float(logprobs[j, chosen]),
            top=list(zip(top_ids[j, :n].tolist(), top_values[j, :n].tolist())))
    return result


class Sampler:
    def __init__(self, sync_free: bool | None = None):
        """sync_free: draw without reading the logits' device (module doc); None: where the
        logits are not on the CPU (a test sets True to run that path on a CPU)."""
        self.sync_free = sync_free

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]):
        """logits [N, vocab] float32 -> (token ids [N] list, logprobs list of TokenLogprob|None)."""
        token_ids = self.draw(logits, rows)
        return token_ids.tolist(), compute_logprobs(logits, token_ids, rows)

    def draw(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """The rows' tokens [N] where the logits are, not waited for (a grammar row whose
        draw it refuses waits, to ask it); `logits` is left as it was, for the logprobs."""
        sync_free = (logits.device.type != "cpu") if self.sync_free is None else self.sync_free
        if any(r.params.logit_bias for r in rows):
            logits = apply_logit_bias(logits.clone(), rows)
        draw_first = [r.grammar is not None and not sync_free and _draws_before_mask(r.params)
                      for r in rows]
        mask_first = [r.grammar if r.grammar is not None and not first else None
                      for r, first in zip(rows, draw_first)]
        if any(m is not None for m in mask_first):
            logits = apply_grammar_masks(logits.clone(), mask_first)
        logits = apply_penalties(logits.clone(), rows) if _any_penalty(rows) else logits
        token_ids = _draw(logits, rows, sync_free)
        refused = [i for i, first in enumerate(draw_first)
                   if first and not rows[i].grammar.allows(int(token_ids[i]))]
        if refused:  # masking commutes with the penalties: the penalised logits are reused
            again = [rows[i] for i in refused]
            masked = apply_grammar_masks(logits[refused], [r.grammar for r in again])
            token_ids[refused] = _draw(masked, again, sync_free)
        return token_ids


def _draws_before_mask(params: SamplingParams) -> bool:
    return params.greedy or not (params.top_k > 0 or params.top_p < 1.0 or params.min_p > 0)


def _draw(logits: torch.Tensor, rows: list[SamplingRow], sync_free: bool) -> torch.Tensor:
    """One token per row: greedy rows the argmax, the others a draw at their temperature
    from what their top-k / top-p / min-p keep."""
    token_ids = logits.argmax(dim=-1)
    sampled = [i for i, r in enumerate(rows) if not r.params.greedy]
    if sampled:
        sub_rows = [rows[i] for i in sampled]
        device = logits.device
        sub = logits[sampled] / to_device([r.params.temperature for r in sub_rows],
                                          logits.dtype, device).unsqueeze(1)
        # The mask costs a top-1024 (or a sort of the vocabulary): only when a row truncates.
        if any(r.params.top_k > 0 or r.params.top_p < 1.0 or r.params.min_p > 0 for r in sub_rows):
            keep = truncation_mask(
                sub,
                to_device([r.params.top_k for r in sub_rows], torch.long, device),
                to_device([r.params.top_p for r in sub_rows], torch.float32, device),
                to_device([r.params.min_p for r in sub_rows], torch.float32, device),
                sync_free,
            )
            sub = sub.masked_fill(~keep, float("-inf"))
        token_ids[sampled] = sample_from_probs(sub.softmax(dim=-1), sub_rows)
    return token_ids


def _any_penalty(rows: list[SamplingRow]) -> bool:
    return any(r.params.repetition_penalty != 1.0 or r.params.presence_penalty
               or r.params.frequency_penalty for r in rows)
