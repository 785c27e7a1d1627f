"""Optional C++ kernels (paged decode and prefill attention, fused layer ops, 4-bit and 8-bit
GEMMs for GGUF weights), compiled with torch's
extension builder on first use (make install does it once, so serving never waits for a
compiler). Without a compiler, callers fall back to the torch code and say so once."""
from __future__ import annotations

import glob
import hashlib
import logging
import os
from functools import lru_cache

logger = logging.getLogger("pagedllm.kernels")
_HERE = os.path.dirname(__file__)
_SOURCES = [os.path.join(_HERE, name) for name in
            ("bindings.cpp", "paged_attention.cpp", "prefill_attention.cpp", "fused_ops.cpp",
             "q4_gemm.cpp", "q8_gemm.cpp", "decode_layers.cpp")]


def _headers_digest() -> str:
    """torch's builder rebuilds when a listed .cpp or a flag changes, not a header: the
    headers' digest goes into the flags so that editing one rebuilds too."""
    digest = hashlib.sha1()
    for path in sorted(glob.glob(os.path.join(_HERE, "*.h"))):
        with open(path, "rb") as f:
            digest.update(f.read())
    return digest.hexdigest()[:12]


@lru_cache(maxsize=1)
def kernel_ops():
    """The compiled module, or None when it cannot be built here (or PAGEDLLM_NO_KERNELS)."""
    if os.environ.get("PAGEDLLM_NO_KERNELS"):
        return None
    try:
        from torch.utils.cpp_extension import load

        return load(name="pagedllm_kernels", sources=_SOURCES,
                    extra_cflags=["-O3", "-march=native", "-ffast-math", "-fopenmp",
                                  f"-DPAGEDLLM_HEADERS={_headers_digest()}"],
                    extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as exc:  # noqa: BLE001 - any build problem means: use the torch path
        logger.warning("C++ kernels unavailable (%s); using the torch path",
                       str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        return None
