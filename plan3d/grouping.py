"""Top-K as distinct decisions: layouts that tie are one row, with the alternatives named.

Two ranked layouts are the same decision when they share the knobs that change what runs where
(tp, pp, dp, micro-batch, ZeRO stage) and their objective differs by less than `TIE_FRACTION`:
they differ only in recompute, sequence parallelism, rank order, the number of virtual stages
or an uneven split, and the model cannot tell them apart within its noise (its left-out error is
several per cent; a 0.4% difference is not a decision). Virtual stages fold too: vpp5 and vpp8
of one tp/pp/dp within 0.2% are one choice, "interleave"; vpp1 against vpp5 differs by the
bubble, which is usually more than the tie, and then stays a row of its own. The best of them heads the row; the others are named
as its alternatives. A same-shape layout further than `TIE_FRACTION` away is a real trade-off
(full recompute for memory headroom, say) and gets its own row.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from plan3d.layout import Layout

DECISION_KNOBS = ("tp", "pp", "dp", "micro_batch", "zero")
TIE_FRACTION = 0.01


@dataclass
class Decision:
    """One row of the top-K: the best layout of a decision and the near-ties it stands for."""

    head: int
    alternatives: list[int] = field(default_factory=list)


def objective_values(metrics: dict[str, np.ndarray], objective: str) -> np.ndarray:
    """The objective as 'higher is better' values (memory: the negated peak bytes)."""
    if objective == "memory":
        return -np.asarray(metrics["peak_memory_bytes"], dtype=float)
    return np.asarray(metrics["tokens_per_s" if objective == "throughput" else "mfu"], dtype=float)


def ties(head_value: float, value: float) -> bool:
    """Whether `value` is within TIE_FRACTION of `head_value` (both 'higher is better')."""
    return abs(head_value - value) <= TIE_FRACTION * abs(head_value)


def group_decisions(layouts: dict[str, np.ndarray], values: np.ndarray, ranked: np.ndarray,
                    limit: int) -> list[Decision]:
    """The first `limit` decisions among `ranked` feasible rows, each with its tying alternatives.

    Scans in rank order; a row joins the decision of its shape when it ties with that decision's
    head, and opens a new decision otherwise. One decision past `limit` is kept, so that a caller
    can name the next real alternative. Stops once every later row is too slow to tie with any
    kept head (ranked rows are best first).
    """
    decisions: list[Decision] = []
    by_shape: dict[tuple, Decision] = {}
    for row in (int(r) for r in ranked):
        shape = tuple(int(layouts[k][row]) for k in DECISION_KNOBS)
        decision = by_shape.get(shape)
        if decision is not None and ties(values[decision.head], values[row]):
            decision.alternatives.append(row)
            continue
        if len(decisions) > limit:
            if not ties(values[decisions[-1].head], values[row]):
                break
            continue
        decision = Decision(row)
        decisions.append(decision)
        by_shape[shape] = decision
    return decisions


def difference(head: Layout, other: Layout) -> str:
    """What `other` changes against `head`, in a few words ("selective recompute, order tp-cp-ep-pp-dp")."""
    parts = []
    if other.vpp != head.vpp:
        parts.append(f"vpp{other.vpp}")
    if other.recompute != head.recompute:
        parts.append(f"{other.recompute} recompute")
    if other.sequence_parallel != head.sequence_parallel:
        parts.append("sp" if other.sequence_parallel else "no sp")
    if other.order != head.order:
        parts.append(f"order {other.order}")
    if other.pp_layers != head.pp_layers:
        parts.append("even split" if other.pp_layers is None else "uneven split")
    return ", ".join(parts) or "same knobs"
