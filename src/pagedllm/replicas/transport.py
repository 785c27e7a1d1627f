"""What a replica sends the ingress for a request: deltas only, several steps at once.

A RequestOutput carries cumulative fields (the prompt, every token and the text so far)
that are free to pass within one process but grow with every step across one: a replica
sends each step's new tokens, text and logprobs, merged over every output waiting when the
transport is ready for more, and the ingress rebuilds the cumulative fields."""
from __future__ import annotations

import dataclasses

from pagedllm.core.request import RequestOutput


def pack(items: list) -> list:
    """Queue positions as they are; the outputs among them merged into one delta."""
    packed, merged = [], None
    for item in items:
        if not isinstance(item, RequestOutput):
            packed.append(item)
            continue
        delta = dataclasses.replace(item, prompt_token_ids=[], token_ids=[], text="",
                                    logprobs=None)
        if merged is None:
            merged = delta
        else:
            merged = dataclasses.replace(
                delta, new_token_ids=merged.new_token_ids + delta.new_token_ids,
                new_text=merged.new_text + delta.new_text,
                new_logprobs=(None if delta.new_logprobs is None
                              else (merged.new_logprobs or []) + delta.new_logprobs))
    if merged is not None:
        packed.append(merged)
    return packed


def unpack(delta: RequestOutput, last: RequestOutput | None,
           prompt_token_ids: list[int]) -> RequestOutput:
    """The full RequestOutput the local engine would have given, from the one before."""
    logprobs = None
    if delta.new_logprobs is not None:
        logprobs = (last.logprobs if last and last.logprobs else []) + delta.new_logprobs
    return dataclasses.replace(
        delta, prompt_token_ids=prompt_token_ids,
        token_ids=(last.token_ids if last else []) + delta.new_token_ids,
        text=(last.text if last else "") + delta.new_text, logprobs=logprobs)


__all__ = ["pack", "unpack"]
