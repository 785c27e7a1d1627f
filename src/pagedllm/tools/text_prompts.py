"""Prompts of realistic lengths made from real text (a bundled English corpus), with a seed.

Used by the load benchmark and the tests: each prompt is a window of the corpus at a random
offset, so prompts are distinct unless a shared prefix is asked for.
"""
from __future__ import annotations

import random
from functools import lru_cache
from importlib import resources


@lru_cache(maxsize=1)
def corpus_text() -> str:
    return resources.files("pagedllm").joinpath("data/corpus.txt").read_text(encoding="utf-8")


def corpus_tokens(tokenizer) -> list[int]:
    return tokenizer.encode(corpus_text(), add_special_tokens=False)


def make_prompt_token_ids(tokenizer, lengths: list[int], seed: int = 0,
                          shared_prefix_tokens: int = 0) -> list[list[int]]:
    """One token-id prompt per requested length: a shared prefix (if any) then a window of
    the corpus starting at a random offset, wrapping around at its end."""
    tokens = corpus_tokens(tokenizer)
    rng = random.Random(seed)
    prefix = tokens[:shared_prefix_tokens] if shared_prefix_tokens else []
    prompts = []
    for length in lengths:
        body_len = max(1, length - len(prefix))
        start = rng.randrange(len(tokens))
        body = [tokens[(start + i) % len(tokens)] for i in range(body_len)]
        prompts.append(prefix + body)
    return prompts
