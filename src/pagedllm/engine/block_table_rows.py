"""The running requests' block tables, kept across steps as rows of one array (vLLM's
persistent batch), so that a step's padded tables are one gather instead of a Python list
per request rebuilt and converted every step.

A request's row is written when its plan brings a table that is not the tuple written last:
the KV manager hands out the same tuple until the request's blocks change (a new block every
block_size tokens while it decodes, a trim, a resume after preemption: core/kv_cache/
manager.py), so most steps write nothing. Anything but a tuple (a hand-made plan's list,
which could have changed in place) is written every time.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class BlockTableRows:
    def __init__(self, num_rows: int = 64, width: int = 16):
        self.array = np.zeros((num_rows, width), dtype=np.int64)
        self._row: dict[str, int] = {}
        self._written: dict[str, Sequence[int]] = {}
        self._free_rows = list(range(num_rows - 1, -1, -1))

    def __len__(self) -> int:
        """Requests holding a row."""
        return len(self._row)

    def row_of(self, request_id: str, table: Sequence[int]) -> int:
        """The request's row, holding `table` from its first entry (what lies past it in the
        row is stale: gather() reads each row only up to its count)."""
        row = self._row.get(request_id)
        if row is None:
            if not self._free_rows:
                self._grow_rows()
            row = self._row[request_id] = self._free_rows.pop()
        if type(table) is not tuple or self._written.get(request_id) is not table:
            if len(table) > self.array.shape[1]:
                self._grow_width(len(table))
            self.array[row, :len(table)] = table
            self._written[request_id] = table
        return row

    def gather(self, rows: list[int], counts: list[int]) -> np.ndarray:
        """[len(rows), widest count] the rows' first counts[i] entries, then block 0 (a row
        may appear several times: a verifying request's positions)."""
        width = max(max(counts, default=0), 1)
        if not rows:
            return np.zeros((1, width), dtype=np.int64)
        tables = self.array[rows, :width]  # a copy: fancy indexing
        tables[np.arange(width) >= np.asarray(counts)[:, None]] = 0
        return tables

    def forget(self, request_id: str) -> None:
        """The request ended: its row is free for the next one."""
        row = self._row.pop(request_id, None)
        self._written.pop(request_id, None)
        if row is not None:
            self._free_rows.append(row)

    def _grow_rows(self) -> None:
        old = self.array.shape[0]
        self.array = np.concatenate([self.array, np.zeros_like(self.array)])
        self._free_rows.extend(range(2 * old - 1, old - 1, -1))

    def _grow_width(self, width: int) -> None:
        wider = np.zeros((self.array.shape[0], max(width, 2 * self.array.shape[1])),
                         dtype=np.int64)
        wider[:, :self.array.shape[1]] = self.array
        self.array = wider
