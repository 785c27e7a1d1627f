"""Optional C++ kernels, compiled with torch's extension builder on first use (make install
does it once, so serving never waits for a compiler). Without a compiler, callers fall back
to the torch code and say so once."""
from __future__ import annotations

import logging
import os
from functools import lru_cache

logger = logging.getLogger("pagedllm.kernels")
_SOURCE = os.path.join(os.path.dirname(__file__), "paged_attention.cpp")


@lru_cache(maxsize=1)
def paged_attention_ops():
    """The compiled module, or None when it cannot be built here."""
    if os.environ.get("PAGEDLLM_NO_KERNELS"):
        return None
    try:
        from torch.utils.cpp_extension import load

        return load(name="pagedllm_paged_attention", sources=[_SOURCE],
                    extra_cflags=["-O3", "-march=native", "-ffast-math", "-fopenmp"],
                    extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as exc:  # noqa: BLE001 - any build problem means: use the torch path
        logger.warning("C++ paged attention unavailable (%s); using the torch path",
                       str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        return None
