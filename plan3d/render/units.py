"""SI values to human units, only when rendering."""
from __future__ import annotations

GIB = 2**30


def gib(n_bytes: float) -> str:
    return f"{n_bytes / GIB:.1f} GiB"


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


def gbytes_per_s(value: float) -> str:
    return f"{value / 1e9:.1f} GB/s"


def count(n: float) -> str:
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.2f}{unit}"
    return f"{n:.0f}"
