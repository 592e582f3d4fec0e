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


def json_text(payload, indent: int | None = 1) -> str:
    """Strict JSON (RFC 8259: no NaN or Infinity tokens); a non-finite number anywhere is a
    user error naming where it is, never an invalid document."""
    import json

    from plan3d.cost.finite import NonFinitePrediction

    try:
        return json.dumps(payload, indent=indent, allow_nan=False)
    except ValueError:
        where = nonfinite_path(payload) or "a value"
        raise NonFinitePrediction(f"the output field {where} is not a finite number; the inputs that produced it "
                                  "are not physical (check the specs for extreme values)") from None


def nonfinite_path(value, path: str = "") -> str | None:
    """Dotted path of the first NaN or infinite float inside dicts and lists, or None."""
    import math

    if isinstance(value, float):
        return None if math.isfinite(value) else (path or "(top level)")
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, (list, tuple)) else ()
    for key, item in items:
        found = nonfinite_path(item, f"{path}.{key}" if path else str(key))
        if found:
            return found
    return None


def printable(text: str) -> str:
    """`text` on one line: newlines and other control characters written as escapes (\\n, \\x1b),
    so a name from a spec file cannot start a line of its own (a GitHub workflow command such as
    `::error::`, which the runner reads from any line of a step's output)."""
    return "".join(ch if ch.isprintable() or ch == "\t" else ascii(ch)[1:-1] for ch in text)
