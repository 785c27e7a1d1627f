"""Host values (a step's ids, positions, temperatures) onto the model's device without
waiting for the device.

`torch.tensor(values, device="cuda")` copies blocking, and a blocking copy to a GPU first
waits for all the work queued before it: the host then stands still until the step in
flight is done, which undoes overlapped steps (engine/overlap.py). The copy here is made on
the host and sent non-blocking (CUDA stages pageable memory at once, so the host's list may
go away). On the CPU it is the plain tensor.
"""
from __future__ import annotations

import torch


def to_device(values, dtype: torch.dtype, device) -> torch.Tensor:
    tensor = torch.tensor(values, dtype=dtype)
    return tensor if torch.device(device).type == "cpu" else tensor.to(device, non_blocking=True)
