"""SI values to human units, only when rendering."""
from __future__ import annotations

import json
import math

from plan3d.errors import NonFinitePrediction
from plan3d.specs.base import printable  # noqa: F401  (defined with the one-line rule of spec names; renderers import it here)

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


def json_text(payload, indent: int | None = 1) -> str:
    """Strict JSON (RFC 8259: no NaN or Infinity tokens); a non-finite number anywhere is a
    user error naming where it is, never an invalid document."""
    try:
        return json.dumps(payload, indent=indent, allow_nan=False)
    except ValueError:
        where = nonfinite_path(payload) or "a value"
        raise NonFinitePrediction(f"the output field {where} is not a finite number; the inputs that produced it "
                                  "are not physical (check the specs for extreme values)") from None


def nonfinite_path(value, path: str = "") -> str | None:
    """Dotted path of the first NaN or infinite float inside dicts and lists, or None."""
    if isinstance(value, float):
        return None if math.isfinite(value) else (path or "(top level)")
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, (list, tuple)) else ()
    for key, item in items:
        found = nonfinite_path(item, f"{path}.{key}" if path else str(key))
        if found:
            return found
    return None


