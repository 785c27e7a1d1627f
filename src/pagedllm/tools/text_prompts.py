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


# The instruction of an input-grounded prompt: the answer quotes the prompt (what editing,
# summarising and retrieval answers do), the load speculative decoding is for.
GROUNDED_INSTRUCTION = "Repeat the following text exactly, word for word:"


def grounded_prompt_token_ids(tokenizer, lengths: list[int], seed: int = 0) -> list[list[int]]:
    """Prompts that ask the model to repeat a passage of the corpus (of about the requested
    length): as a chat turn where the model has a chat template, else as plain text."""
    prompts = []
    for body in make_prompt_token_ids(tokenizer, lengths, seed=seed):
        passage = tokenizer.decode(body).strip()
        if tokenizer.chat_template:
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": f"{GROUNDED_INSTRUCTION}\n\n{passage}"}])
            prompts.append(tokenizer.encode(text, add_special_tokens=False))
        else:
            prompts.append(tokenizer.encode(f"{passage}\n\n{GROUNDED_INSTRUCTION}\n\n"))
    return prompts
