"""What this CPU can run, read at run time, and the kernel level chosen from it.

The C++ kernels are built once per instruction-set level (build.py). A level is chosen here
from the CPU's own feature flags, never from what the compiler had, so a cache or `.venv`
carried to a host with fewer instructions falls back instead of dying with SIGILL:

- ``portable``: plain C++ the compiler vectorises for the baseline of the architecture
  (x86-64 SSE2, aarch64 NEON); runs anywhere.
- ``avx2``: AVX2 + FMA + F16C (Intel since Haswell, AMD since Zen 1).
- ``avx512``: AVX-512 F/BW/VL/DQ with BF16 and VNNI (Intel Sapphire Rapids, AMD Zen 4+).
  An AVX-512 CPU without BF16/VNNI (Skylake-X, Ice Lake) runs the avx2 level.

``PAGEDLLM_CPU_ISA`` forces a lower level (to prove or compare the lower paths on a host
that has more); asking for more than the CPU has is an error, not a crash later.

Above avx512, the matrix units: **AMX** tiles (Intel Sapphire Rapids and later) where the CPU
has amx_tile and amx_bf16 *and* Linux grants the process the tiles' state
(ARCH_REQ_XCOMP_PERM; a kernel or VM that refuses it leaves them unusable). Steps with many
rows then multiply 4-bit weights through oneDNN's AMX kernels, and steps of 3 to 127 rows
through the avx512 build's own exact tile kernel (kernels/q4_tiles_amx.h; it checks the CPU
and the permission itself before its first tile instruction); models/quant_linear.py chooses.
``PAGEDLLM_CPU_AMX=0`` (or a level below avx512) turns them off, to compare, or to prove the
fallback.

The exact (few-row) 4-bit products take the activations as 16-bit integers (q4_i16_gemm:
integer dot products) instead of their float form:
- at avx2 on every CPU: the float form costs four instructions a code (shift, mask, convert,
  FMA), which left a decode step bound by the core rather than by memory; the int16 tile's
  vpmaddubsw takes 4 codes x 8 rows an instruction (BENCHMARKS.md, "AVX2: ...");
- at avx512 on **Intel** cores: those issue the bfloat16 pair dot product at a quarter of the
  integer one's rate. AMD's cores keep the bfloat16 pairs, measured at 83 % of the memory
  floor there.
``PAGEDLLM_CPU_INT16=0`` or ``=1`` overrides the choice, to compare.
"""
from __future__ import annotations

import os
import platform
from dataclasses import dataclass

LEVELS = ("portable", "avx2", "avx512")
ENV_VAR = "PAGEDLLM_CPU_ISA"
AMX_ENV_VAR = "PAGEDLLM_CPU_AMX"
AMX_FLAGS = frozenset({"amx_tile", "amx_bf16"})
INT16_ENV_VAR = "PAGEDLLM_CPU_INT16"
# The vendors whose cores take the int16 product by default (see above).
INT16_VENDORS = frozenset({"GenuineIntel"})
# The levels whose builds have the int16 tile (q4_tiles_avx2.h, q4_tiles_avx512.h).
INT16_LEVELS = ("avx2", "avx512")

# Linux /proc/cpuinfo flag names each level needs (x86 only; other machines run portable).
REQUIRED_FLAGS = {
    "portable": frozenset(),
    "avx2": frozenset({"avx2", "fma", "f16c"}),
    "avx512": frozenset({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq",
                         "avx512_bf16", "avx512_vnni"}),
}


class UnsupportedISAError(ValueError):
    """PAGEDLLM_CPU_ISA names an unknown level, or one this CPU cannot run."""


@dataclass(frozen=True)
class Capabilities:
    """One record of what runs here: every kernel and layer implementation is chosen from it."""
    machine: str            # platform.machine(): x86_64, aarch64, ...
    flags: frozenset[str]   # the CPU's feature flags as the OS reports them
    best: str               # the highest level this CPU can run
    level: str              # the level in use: best, or lower where PAGEDLLM_CPU_ISA says
    amx: bool = False       # AMX tiles in use (avx512 level, flags, the OS's permission)
    int16: bool = False     # few-row 4-bit products with 16-bit integer activations
    vendor: str = ""        # the CPU's vendor_id (GenuineIntel, AuthenticAMD, ...)

    @property
    def available(self) -> tuple[str, ...]:
        """Every level this CPU can run, lowest first: what the tests exercise."""
        return LEVELS[: LEVELS.index(self.best) + 1]

    @property
    def native_bf16(self) -> bool:
        """Whether bfloat16 matrix products have hardware support at the level in use; where
        not, dense layers multiply in float32 (oneDNN's bf16 path refuses such CPUs)."""
        return self.level == "avx512"

    @property
    def has_amx(self) -> bool:
        """Whether the CPU has AMX tiles (whether or not they are in use)."""
        return AMX_FLAGS <= self.flags

    @property
    def summary(self) -> str:
        """The level in use, with the matrix units where they are: "avx512+amx"."""
        return self.level + ("+amx" if self.amx else "")


def amx_tiles_granted() -> bool:
    """Ask Linux for the AMX tile data state (arch_prctl ARCH_REQ_XCOMP_PERM, feature 18), as
    oneDNN does before its first tile instruction; True once granted (asking again is
    harmless), False where the kernel refuses or the call does not exist."""
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.syscall(158, 0x1023, 18) == 0  # SYS_arch_prctl on x86-64
    except (OSError, AttributeError):
        return False


def _cpuinfo_field(names: tuple[str, ...]) -> str | None:
    """The first CPU's value of the first of `names` in /proc/cpuinfo; None where absent."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in names:
                    return value.strip()
    except OSError:
        pass
    return None


def cpu_flags() -> frozenset[str]:
    """The feature flags of the first CPU in /proc/cpuinfo ("flags" on x86, "Features" on
    ARM); empty where that file does not exist (then only the portable level is chosen)."""
    return frozenset((_cpuinfo_field(("flags", "Features")) or "").split())


def cpu_vendor() -> str:
    """The CPU's vendor_id (x86: GenuineIntel, AuthenticAMD); empty where not reported."""
    return _cpuinfo_field(("vendor_id",)) or ""


def int16_products(level: str, vendor: str, setting: str | None) -> bool:
    """Whether the few-row 4-bit products take 16-bit integer activations: at avx2 always, at
    avx512 on the vendors in INT16_VENDORS, unless `setting` (PAGEDLLM_CPU_INT16) says "0"
    or "1". The portable level has no int16 tile."""
    if level not in INT16_LEVELS:
        return False
    if setting in ("0", "1"):
        return setting == "1"
    return level == "avx2" or vendor in INT16_VENDORS


def best_level(machine: str, flags: frozenset[str]) -> str:
    if machine.lower() not in ("x86_64", "amd64"):
        return "portable"
    return max((lvl for lvl in LEVELS if REQUIRED_FLAGS[lvl] <= flags), key=LEVELS.index)


def resolve_level(best: str, requested: str | None) -> str:
    """The level to run: `requested` (PAGEDLLM_CPU_ISA) when set, checked against `best`."""
    if not requested:
        return best
    requested = requested.strip().lower()
    if requested not in LEVELS:
        raise UnsupportedISAError(
            f"{ENV_VAR}={requested!r} is not a level; choose one of {', '.join(LEVELS)}")
    if LEVELS.index(requested) > LEVELS.index(best):
        raise UnsupportedISAError(
            f"{ENV_VAR}={requested} asks for more than this CPU has (it runs up to {best}; "
            f"{requested} needs {', '.join(sorted(REQUIRED_FLAGS[requested]))})")
    return requested


def detect(requested: str | None = None) -> Capabilities:
    """This host's record; `requested` defaults to the PAGEDLLM_CPU_ISA environment variable."""
    machine = platform.machine()
    flags = cpu_flags()
    best = best_level(machine, flags)
    if requested is None:
        requested = os.environ.get(ENV_VAR)
    level = resolve_level(best, requested)
    amx = (level == "avx512" and AMX_FLAGS <= flags and os.environ.get(AMX_ENV_VAR) != "0"
           and amx_tiles_granted())
    vendor = cpu_vendor()
    int16 = int16_products(level, vendor, os.environ.get(INT16_ENV_VAR))
    return Capabilities(machine, flags, best, level, amx, int16, vendor)
