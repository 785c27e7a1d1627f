"""What this torch build offers for CPU matmuls besides pagedllm's own kernels, probed once:
the fallbacks models/build.py chooses from when the C++ kernels are missing, and oneDNN's
weight prepacking for dense bfloat16 layers. Private aten ops come and go between torch
releases, so each is looked up, never assumed."""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache


@dataclass(frozen=True)
class TorchOps:
    int4_matmul: bool  # aten._weight_int4pack_mm_for_cpu: 4-bit weights, group scales
    int8_matmul: bool  # aten._weight_int8pack_mm: 8-bit weights, one scale per row
    onednn_prepack: bool  # mkldnn._reorder_linear_weight + _linear_pointwise


@lru_cache(maxsize=None)
def torch_ops() -> TorchOps:
    import torch  # here, not at import: pagedllm.kernels stays importable without torch

    aten, mkldnn = torch.ops.aten, torch.ops.mkldnn
    return TorchOps(
        int4_matmul=hasattr(aten, "_weight_int4pack_mm_for_cpu"),
        int8_matmul=hasattr(aten, "_weight_int8pack_mm"),
        onednn_prepack=(torch.backends.mkldnn.is_available()
                        and hasattr(mkldnn, "_linear_pointwise")
                        and hasattr(mkldnn, "_reorder_linear_weight")),
    )
