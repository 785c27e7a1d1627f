"""Sampling cost per step over the default model's 49,152-token vocabulary: the sampler's
fast paths against what they replaced, measured in one run.

    .venv/bin/python benchmarks/sampler_speed.py [--threads 2]

Truncation (top-p 0.9): best-1,024 candidates first vs sorting the whole vocabulary.
Drawing: inverse CDF (one uniform a row) vs an exponential race (a variate per token).
"""
from __future__ import annotations


import torch

from pagedllm.engine.sampler import _full_sort_mask, truncation_mask
from timing import ms_per_call, parse_args


def main() -> None:
    args = parse_args()
    torch.manual_seed(0)
    print(f"threads={args.threads}, vocabulary 49152; ms per call")
    print("rows  top-p full sort  candidates  speed-up | exp. race  inverse CDF  speed-up")
    for rows in (1, 16):
        logits = torch.randn(rows, 49152) * 3 / 0.7  # temperature 0.7
        top_k, top_p, min_p = torch.zeros(rows, dtype=torch.long), torch.full((rows,), 0.9), torch.zeros(rows)
        full = ms_per_call(lambda: _full_sort_mask(logits, torch.full((rows,), 49152), top_p, min_p))
        fast = ms_per_call(lambda: truncation_mask(logits, top_k, top_p, min_p))
        probs = logits.softmax(dim=-1)

        def race():
            noise = torch.empty_like(probs)
            for i in range(rows):
                noise[i].exponential_()
            return (probs / noise).argmax(dim=-1)

        def inverse_cdf():
            cdf = probs.cumsum(dim=-1)
            targets = torch.rand(rows, 1) * cdf[:, -1:]
            return torch.searchsorted(cdf, targets, right=True)

        slow_draw, fast_draw = ms_per_call(race), ms_per_call(inverse_cdf)
        print(f"{rows:>4}  {full:15.2f}  {fast:10.2f}  {full / fast:7.1f}x | {slow_draw:9.2f}  "
              f"{fast_draw:11.2f}  {slow_draw / fast_draw:7.1f}x")


if __name__ == "__main__":
    main()
