"""Byte counts as people write and read them."""
from __future__ import annotations


def gib(num_bytes: int) -> str:
    return f"{num_bytes / 2**30:.2f} GiB"


def byte_text(num_bytes: int) -> str:
    """Bytes as the largest binary unit that divides them (536870912 -> '512MiB'); what
    parse_bytes reads back to the same count."""
    for unit, shift in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if num_bytes >= 1 << shift and num_bytes % (1 << shift) == 0:
            return f"{num_bytes >> shift}{unit}"
    return str(num_bytes)


def parse_bytes(text: str) -> int:
    """'8GiB', '512MiB', '2GB', '1e9' -> bytes."""
    units = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "kb": 10**3, "mb": 10**6,
             "gb": 10**9, "tb": 10**12, "k": 2**10, "m": 2**20, "g": 2**30, "b": 1}
    value = text.strip().lower()
    for unit, scale in sorted(units.items(), key=lambda u: -len(u[0])):
        if value.endswith(unit):
            return int(float(value[: -len(unit)]) * scale)
    return int(float(value))
