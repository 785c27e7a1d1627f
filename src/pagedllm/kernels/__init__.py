"""Optional C++ kernels (paged decode attention and fused layer ops), compiled with torch's
extension builder on first use (make install does it once, so serving never waits for a
compiler). Without a compiler, callers fall back to the torch code and say so once."""
from __future__ import annotations

import logging
import os
from functools import lru_cache

logger = logging.getLogger("pagedllm.kernels")
_HERE = os.path.dirname(__file__)
_SOURCES = [os.path.join(_HERE, name) for name in
            ("bindings.cpp", "paged_attention.cpp", "fused_ops.cpp")]


@lru_cache(maxsize=1)
def kernel_ops():
    """The compiled module, or None when it cannot be built here (or PAGEDLLM_NO_KERNELS)."""
    if os.environ.get("PAGEDLLM_NO_KERNELS"):
        return None
    try:
        from torch.utils.cpp_extension import load

        return load(name="pagedllm_kernels", sources=_SOURCES,
                    extra_cflags=["-O3", "-march=native", "-ffast-math", "-fopenmp"],
                    extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as exc:  # noqa: BLE001 - any build problem means: use the torch path
        logger.warning("C++ kernels unavailable (%s); using the torch path",
                       str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        return None
