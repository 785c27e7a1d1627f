"""Compiles the C++ kernels once per instruction-set level (cpu.py), the way vLLM ships
_C_AVX2 / _C_AVX512 and ggml builds every CPU variant. The sources are the same for every
level; what differs is the target flags, so `#if defined(__AVX512BF16__)` and the like inside
a build say what that build may use, and the level chosen at run time says which build loads.

Each build is cached by torch's extension builder under a name that holds the level and a
digest of the flags and headers: a cache built on one host is reused on another only where
it was built for the same level with the same flags, and a level this CPU lacks is never
loaded. `make install` builds the level this host serves at (`make test` every level it can
run), so serving never waits for g++.

Only bindings.cpp includes torch's headers (~20 s of parsing a file); the kernel files are
plain C++ on raw pointers (kernels.h), so a level compiles in under a minute on 2 cores.
"""
from __future__ import annotations

import glob
import hashlib
import logging
import os
import platform
import time
from functools import lru_cache

from pagedllm.kernels.cpu import LEVELS

logger = logging.getLogger("pagedllm.kernels")
_HERE = os.path.dirname(__file__)
SOURCES = [os.path.join(_HERE, name) for name in
           ("bindings.cpp", "paged_attention.cpp", "prefill_attention.cpp", "fused_ops.cpp",
            "q4_gemm.cpp", "q6_gemm.cpp", "q8_gemm.cpp", "lora_sgmv.cpp", "q4_dequant.cpp",
            "roof.cpp")]

# Every build: hidden symbols, so two levels loaded in one process (the tests load each)
# never resolve each other's functions.
COMMON_FLAGS = ("-O3", "-ffast-math", "-fopenmp", "-fvisibility=hidden", "-fvisibility-inlines-hidden")
# Target flags per level. "portable" names no target at all: the architecture's baseline.
X86_TARGET_FLAGS = {
    "portable": (),
    "avx2": ("-mavx2", "-mfma", "-mf16c"),
    "avx512": ("-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl",
               "-mavx512dq", "-mavx512bf16", "-mavx512vnni"),
}


def target_flags(level: str, machine: str | None = None) -> tuple[str, ...]:
    if level not in LEVELS:
        raise ValueError(f"unknown level {level!r}")
    machine = (machine or platform.machine()).lower()
    if machine in ("x86_64", "amd64"):
        return X86_TARGET_FLAGS[level]
    if level != "portable":
        raise ValueError(f"level {level} exists only on x86-64, not on {machine}")
    return ()


def _digest(flags: tuple[str, ...]) -> str:
    """Flags and headers: torch's builder rebuilds when a listed .cpp changes, not a header."""
    digest = hashlib.sha1(" ".join(flags).encode())
    for path in sorted(glob.glob(os.path.join(_HERE, "*.h"))):
        with open(path, "rb") as f:
            digest.update(f.read())
    return digest.hexdigest()[:10]


def module_name(level: str) -> str:
    flags = COMMON_FLAGS + target_flags(level)
    return f"pagedllm_kernels_{level}_{_digest(flags)}"


# A build takes a few minutes; a lock older than this was left by a build that was killed
# (a server stopped while it compiled), on which torch's builder would wait forever.
STALE_LOCK_SECONDS = 15 * 60
# A younger lock is stale too when nothing works in its build folder (ninja and the compiler
# run there): past this age a live build is always in that phase, not still preparing.
QUIET_LOCK_SECONDS = 30


def _build_running_in(folder: str) -> bool:
    """Whether a process is at work in the build folder (its current directory)."""
    import psutil

    folder = os.path.realpath(folder)
    for proc in psutil.process_iter(["cwd"]):
        cwd = proc.info.get("cwd")
        if cwd and os.path.realpath(cwd) == folder:
            return True
    return False


def _check_lock(name: str) -> None:
    """Clears a stale build lock (old, or with no build at work in its folder); says so when
    a live one will make this process wait."""
    from torch.utils.cpp_extension import _get_build_directory

    folder = _get_build_directory(name, verbose=False)
    lock = os.path.join(folder, "lock")
    try:
        age = time.time() - os.path.getmtime(lock)
    except OSError:
        return  # no lock: the usual case
    if age > STALE_LOCK_SECONDS or (age > QUIET_LOCK_SECONDS and not _build_running_in(folder)):
        logger.warning("removing a stale kernel build lock (%s, %.0f s old, no build at work)",
                       lock, age)
        try:
            os.remove(lock)
        except OSError:
            pass
    else:
        logger.warning("waiting for another process building these kernels (lock %s, %.0f s old); "
                       "if none is running, delete that file", lock, age)


def build_folder(level: str) -> str:
    from torch.utils.cpp_extension import _get_build_directory

    return _get_build_directory(module_name(level), verbose=False)


def is_built(level: str) -> bool:
    """Whether this level's module is already compiled here (loading it takes a second)."""
    return os.path.exists(os.path.join(build_folder(level), module_name(level) + ".so"))


def compiled_files(level: str, since: float) -> int:
    """How many of the sources have been compiled since `since` (progress of a build)."""
    folder = build_folder(level)
    count = 0
    for source in SOURCES:
        obj = os.path.join(folder, os.path.splitext(os.path.basename(source))[0] + ".o")
        try:
            count += os.path.getmtime(obj) >= since
        except OSError:
            pass
    return count


@lru_cache(maxsize=None)
def build(level: str):
    """The compiled module for `level` (callers check the CPU can run it), or None when it
    cannot be built here; the torch code then runs and the reason is logged once."""
    try:
        from torch.utils.cpp_extension import load

        flags = list(COMMON_FLAGS + target_flags(level))
        _check_lock(module_name(level))
        if not is_built(level):  # say so: the first start on a host compiles for minutes
            logger.warning("compiling the %s C++ kernels (%d files; once per host, about a minute on 2 "
                           "cores; `python -m pagedllm.kernels` does it ahead)",
                           level, len(SOURCES))
        return load(name=module_name(level), sources=SOURCES, extra_cflags=flags,
                    extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as exc:  # noqa: BLE001 - any build problem means: use the torch path
        logger.warning("C++ kernels (%s) unavailable (%s); using the torch path", level,
                       str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        return None
