"""Optional C++ kernels (paged decode and prefill attention, fused layer ops, 4-bit and 8-bit
GEMMs for GGUF weights), built once per CPU level (build.py) and chosen at run time from what
the CPU has (cpu.py). Every level has every kernel: the portable build in plain C++, the
higher ones with AVX2 or AVX-512 intrinsics where they pay. Without a compiler (or with
PAGEDLLM_NO_KERNELS set), callers fall back to the torch ops torch_ops() finds and say so
once. These three records (capabilities, kernel_ops, torch_ops) are the only probes: the
models choose from them in one place, models/build.py.

The C++ side: kernels.h declares the kernels on raw pointers and sizes (plain.h: the 16-bit
float types, the parallel loop), defined in paged_attention.cpp, prefill_attention.cpp,
fused_ops.cpp and q4/q6/q8_gemm.cpp (q4_gemm's tiles per level in q4_tiles_*.h, the AMX
tiles' exact product in q4_tiles_amx.h), none of which includes torch; bindings.cpp, the one
unit that does, binds them as torch ops that check their tensors (tensor_ops.h) and the
decode loop over those ops (decode_layers.h)."""
from __future__ import annotations

import os
from functools import lru_cache

from pagedllm.kernels.cpu import (AMX_ENV_VAR, ENV_VAR, INT16_ENV_VAR, LEVELS, Capabilities,
                                  UnsupportedISAError, detect)
from pagedllm.kernels.torch_ops import TorchOps, torch_ops

__all__ = ["LEVELS", "Capabilities", "TorchOps", "UnsupportedISAError", "capabilities",
           "kernel_ops", "kernels_for", "torch_ops"]


@lru_cache(maxsize=None)
def _capabilities(requested: str | None, amx: str | None, int16: str | None) -> Capabilities:
    return detect(requested or "")


def capabilities() -> Capabilities:
    """This CPU's record, with the level PAGEDLLM_CPU_ISA asks for, AMX unless
    PAGEDLLM_CPU_AMX=0, and PAGEDLLM_CPU_INT16's choice (read on every call, so a test or a
    benchmark can switch between models)."""
    return _capabilities(os.environ.get(ENV_VAR) or None, os.environ.get(AMX_ENV_VAR),
                         os.environ.get(INT16_ENV_VAR))


def kernels_for(level: str):
    """The compiled module of one level (the CPU must run it), or None where it cannot build."""
    if os.environ.get("PAGEDLLM_NO_KERNELS"):
        return None
    if level not in capabilities().available:
        raise UnsupportedISAError(f"this CPU cannot run the {level} kernels "
                                  f"(it runs {', '.join(capabilities().available)})")
    from pagedllm.kernels.build import build

    return build(level)


def kernel_ops():
    """The compiled module of the level in use, or None (no compiler, PAGEDLLM_NO_KERNELS)."""
    return kernels_for(capabilities().level)
