"""A quantized GGUF matrix as the file holds it, read into the form its user asks for.

The loader keeps every quantized 2-D weight this way (a view of the memory-mapped file) and
decodes nothing up front: the bfloat16 model with the C++ kernels takes 4-bit types as 4-bit
codes (q4), Q6_K as 6-bit codes (q6) and the other types as 8-bit codes (q8), and only what
runs dense (float32 models, the paths without the kernels) is dequantized (dense). So a Q4_K_M file never holds
a float copy of its projections in memory, not even while it loads.
"""
from __future__ import annotations

import mmap
from dataclasses import dataclass

import numpy as np
import torch

from pagedllm.weights.permute import row_order_unpermute, unpermute_rows
from pagedllm.weights.q4 import Q4KWeight, Q4Weight, decode_q4, decode_q4_k
from pagedllm.weights.q6 import Q6Weight, decode_q6_k
from pagedllm.weights.q8 import Q8Rows, decode_q8_0, quantize_q8_0

# Types whose groups are w = code * d + m with 4-bit codes: the 4-bit kernels take them as
# they are, as the 6-bit kernel takes Q6_K. The rest (Q8_0 as it is; Q5_* and the i-quants
# rounded to Q8_0) take the 8-bit kernel.
FOUR_BIT_TYPES = ("Q4_0", "Q4_1", "Q4_K")
SIX_BIT_TYPE = "Q6_K"
# Rows dequantized at a time when rounding to Q8_0: a float32 copy of a whole embedding of
# a 1-2B model would take ~400 MB.
_CHUNK_ROWS = 4096


@dataclass
class GGUFOriginal:
    name: str  # the tensor's name in the file, for messages
    data: np.ndarray  # its bytes, a view of the memory-mapped file
    type_name: str  # GGMLQuantizationType name
    shape: tuple[int, ...]  # (rows, cols) as the model uses it; (experts, rows, cols) stacked
    heads: int | None = None  # llama.cpp permuted the rows by this many heads (q, k)
    # The file's mapping and this tensor's bytes in it (offset, length), for drop_file_pages.
    mapping: tuple[mmap.mmap, int, int] | None = None

    def expert(self, index: int) -> GGUFOriginal:
        """One expert's matrix of a stacked [experts, rows, cols] tensor."""
        mapping = None
        if self.mapping is not None:
            file_map, offset, length = self.mapping
            size = length // self.shape[0]
            mapping = (file_map, offset + index * size, size)
        return GGUFOriginal(f"{self.name}[{index}]", self.data[index], self.type_name,
                            self.shape[1:], self.heads, mapping)

    def drop_file_pages(self) -> None:
        """This tensor's pages of the file leave the process's resident memory (the page
        cache keeps them; a later read faults them back in). Called once its codes are
        converted: a model then never holds the whole file and all its codes at once."""
        if self.mapping is None:
            return
        mapping, offset, length = self.mapping
        start = offset // mmap.PAGESIZE * mmap.PAGESIZE
        try:
            mapping.madvise(mmap.MADV_DONTNEED, start, offset + length - start)
        except (AttributeError, OSError, ValueError):  # no madvise here: the pages stay
            pass

    @property
    def four_bit(self) -> bool:
        return self.type_name in FOUR_BIT_TYPES

    def dense(self) -> torch.Tensor:
        """The exact float32 weights, as the gguf package dequantizes them."""
        from gguf import GGMLQuantizationType, quants

        array = np.array(quants.dequantize(self.data, GGMLQuantizationType[self.type_name]),
                         dtype=np.float32).reshape(self.shape)
        if self.heads:
            array = unpermute_rows(array, self.heads)
        return torch.from_numpy(np.ascontiguousarray(array))

    @property
    def six_bit(self) -> bool:
        return self.type_name == SIX_BIT_TYPE

    def q4(self) -> Q4Weight | Q4KWeight:
        """4-bit codes and their scales, exactly the weights dense() gives."""
        if self.type_name == "Q4_K":
            q4 = decode_q4_k(self.data, self.shape)
        else:
            q4 = decode_q4(self.data, self.type_name, self.shape)
        return self._rows_in_order(q4)

    def q6(self) -> Q6Weight:
        """Q6_K's 6-bit codes and scales, exactly the weights dense() gives."""
        return self._rows_in_order(decode_q6_k(self.data, self.shape))

    def _rows_in_order(self, weight):
        """A decoded weight, once this tensor's file pages are dropped, with a permuted q / k's
        rows put back in order."""
        self.drop_file_pages()
        return weight.permute_rows(row_order_unpermute(self.shape[0], self.heads)) if self.heads else weight

    def q8(self) -> Q8Rows:
        """8-bit codes and per-32 scales: Q8_0 exactly, other types rounded to it (a chunk of
        rows at a time)."""
        if self.type_name == "Q8_0":
            q8 = decode_q8_0(self.data, self.shape)
        else:
            from gguf import GGMLQuantizationType, quants

            rows, cols = self.shape
            raw = np.asarray(self.data, dtype=np.uint8).reshape(rows, -1)
            qtype = GGMLQuantizationType[self.type_name]
            parts = [quantize_q8_0(torch.from_numpy(np.array(
                         quants.dequantize(raw[start:start + _CHUNK_ROWS], qtype),
                         dtype=np.float32).reshape(-1, cols)))
                     for start in range(0, rows, _CHUNK_ROWS)]
            q8 = Q8Rows.cat(parts)
        self.drop_file_pages()
        if self.heads:  # the rows of a permuted q / k put back in order
            index = torch.from_numpy(row_order_unpermute(self.shape[0], self.heads))
            q8 = Q8Rows(q8.codes[index], q8.scales[index])
        return q8
