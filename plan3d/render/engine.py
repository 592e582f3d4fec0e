"""The line that names the engine a prediction is for, and where its fitted values come from."""
from __future__ import annotations

from rich.markup import escape

from plan3d.render.units import printable


def engine_text(engine) -> str:
    """`megatron-core (Megatron-Core (2024-2025), ...)`: the name and what it is."""
    return printable(engine.name + (f" ({engine.description})" if engine.description else ""))


def engine_line(engine) -> str:
    """The first line of every prediction's output (rich markup escaped)."""
    return escape(f"engine: {engine_text(engine)}")


def provenance_lines(lines: list[str]) -> list[str]:
    """`provenance: ...` lines of an Estimate's provenance (rich markup escaped)."""
    return [escape(f"provenance: {line}") for line in lines]
