"""Top-K as distinct decisions: one row per tp/pp/dp/micro-batch/ZeRO, near-ties named.

A user asking for the top 8 wants 8 different decisions, not rows that differ only in how a
layout is run. Ranked layouts that share the knobs that change what runs where (tp, pp, dp,
micro-batch, ZeRO stage) are one decision: the best of them is its row. Those within
`TIE_FRACTION` of it (another recompute mode, sequence parallelism, rank order, number of
virtual stages or an uneven split) are named as its alternatives: the model cannot tell them
apart (its left-out error is several per cent, and layouts of one shape share most of it).
Slower layouts of the same shape are not shown: they are the same decision run worse, and the
memory they may save is what the Pareto front reports.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from plan3d.layout import Layout, short_order

DECISION_KNOBS = ("tp", "pp", "dp", "cp", "ep", "micro_batch", "zero")
TIE_FRACTION = 0.02


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

    Scans in rank order: the first row of a shape opens its decision, a later one joins it when
    it ties with the head and is passed over otherwise. One decision past `limit` is kept, so
    that a caller can name the next real alternative. Stops once every later row is too slow to
    tie with any kept head (ranked rows are best first).
    """
    decisions: list[Decision] = []
    by_shape: dict[tuple, Decision] = {}
    for row in (int(r) for r in ranked):
        shape = tuple(int(layouts[k][row]) for k in DECISION_KNOBS if k in layouts)
        decision = by_shape.get(shape)
        if decision is not None:
            if ties(values[decision.head], values[row]):
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
    if other.expert_tp != head.expert_tp:
        parts.append(f"etp{other.expert_tp}")
    if other.vpp != head.vpp:
        parts.append(f"vpp{other.vpp}")
    if other.pipeline_schedule != head.pipeline_schedule and other.pp > 1:
        parts.append(other.pipeline_schedule)
    if other.recompute != head.recompute:
        parts.append(f"{other.recompute} recompute")
    if other.sequence_parallel != head.sequence_parallel:
        parts.append("sp" if other.sequence_parallel else "no sp")
    if other.order != head.order:
        parts.append(f"order {short_order(other.order)}")
    if other.pp_layers != head.pp_layers:
        parts.append("even split" if other.pp_layers is None else "uneven split")
    return ", ".join(parts) or "same knobs"
