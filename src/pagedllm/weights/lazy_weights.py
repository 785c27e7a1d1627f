"""A checkpoint's canonical weights where some are dequantized only when read.

A GGUF's quantized matrices stay in the file (GGUFOriginal) until someone asks: reading
`weights[name]` gives the exact float32 tensor (decoded anew on every read, kept by no one),
while the model builder takes the codes of the ones it keeps low-bit and never reads those
here. Iterating or copying (dict(weights)) reads every weight, which only float32 models
and tests do.
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch


class LazyWeights(Mapping):
    def __init__(self, dense: dict[str, torch.Tensor], originals: dict):
        self.dense = dense  # name -> tensor, held
        self.originals = originals  # name -> GGUFOriginal, decoded when read

    def __getitem__(self, name: str) -> torch.Tensor:
        if name in self.dense:
            return self.dense[name]
        return self.originals[name].dense()

    def __iter__(self) -> Iterator[str]:
        yield from self.dense
        yield from (name for name in self.originals if name not in self.dense)

    def __len__(self) -> int:
        return len(self.dense) + sum(1 for name in self.originals if name not in self.dense)

    def __contains__(self, name) -> bool:
        return name in self.dense or name in self.originals
