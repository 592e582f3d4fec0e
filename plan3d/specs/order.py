"""Rank orders: the five parallel axes and how an order string names them (first varies fastest).

A spec-level vocabulary: engine profiles list the orders they build, layouts carry one. Megatron-LM's
default order tp-cp-ep-dp-pp (megatron/core/parallel_state.py, `RankGenerator`) is the default here.
"""
from __future__ import annotations

from typing import Protocol

from plan3d.errors import LayoutError

AXES = ("tp", "cp", "ep", "dp", "pp")
DEFAULT_ORDER = "tp-cp-ep-dp-pp"


def parse_order(order: str) -> tuple[str, ...]:
    """All five axes of an order string, first varies fastest; raise with a valid example.

    A short order names only some axes, as the recommend table prints it ('pp-dp'): each axis left
    out keeps its slot of Megatron's default tp-cp-ep-dp-pp and the named axes fill the other slots
    in the sequence given, so 'pp-dp' -> tp-cp-ep-pp-dp and 'dp-tp' -> dp-cp-ep-tp-pp. Leaving an
    axis out only places it; its size still comes from the layout.
    """
    axes = tuple(order.split("-"))
    unknown = [a for a in axes if a not in AXES]
    repeated = sorted({a for a in axes if axes.count(a) > 1})
    if unknown or repeated:
        what = f"unknown axis {unknown[0]!r}" if unknown else f"repeated axis {repeated[0]!r}"
        raise LayoutError(
            f"order {order!r}: {what}; name each of tp, cp, ep, dp, pp at most once, first varies fastest "
            f"(axes left out keep their place in {DEFAULT_ORDER!r}), e.g. {DEFAULT_ORDER!r} or 'pp-dp'"
        )
    return _fill_default_slots(axes)


def _fill_default_slots(named: tuple[str, ...]) -> tuple[str, ...]:
    """Axes missing from `named` stay where DEFAULT_ORDER has them; `named` fills the rest in turn."""
    given = iter(named)
    return tuple(next(given) if axis in named else axis for axis in AXES)


class LayoutShape(Protocol):
    """What an engine profile reads of a layout to say whether the engine can run it
    (`plan3d.layout.Layout` is the implementation; specs do not import it)."""

    tp: int
    pp: int
    dp: int
    cp: int
    vpp: int
    zero: int
    sequence_parallel: bool
    recompute: str
    order: str
    pp_layers: tuple[int, ...] | None
    pipeline_schedule: str

    def model_copy(self, *, update: dict | None = None, deep: bool = False) -> "LayoutShape": ...
