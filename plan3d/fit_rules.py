"""Fit rules: when a predicted layout is refused for memory or for the user's thresholds.

One table, read two ways: as reason codes over arrays of predictions by the search
(`plan3d.search.fit_reasons`: the first rule a layout fails) and as sentences with a fix for one
prediction by `plan3d check` (`plan3d.ranking.fit_findings`: every rule it fails). Each rule's
`fails` is one expression that judges a number and an array alike, so the two cannot disagree.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class FitFacts:
    """What the fit rules read, SI units: one prediction's numbers, or equal-length arrays of them."""

    fits: Any  # fits in the usable memory (GPU memory less headroom and reserve)
    mfu: Any
    peak_memory_bytes: Any
    capacity_bytes: Any
    gpu_memory_bytes: float  # the GPU's whole memory, what --max-memory-fraction refers to

    @classmethod
    def of(cls, metrics, gpu_memory_bytes: float) -> FitFacts:
        """From an estimate's dict or the search's metric arrays (same keys)."""
        fits = metrics["fits"]
        return cls(np.asarray(fits, dtype=bool) if isinstance(fits, (list, np.ndarray)) else bool(fits),
                   metrics["mfu"], metrics["peak_memory_bytes"], metrics["capacity_bytes"], gpu_memory_bytes)

    @property
    def memory_fraction(self):
        """Peak memory over the GPU's whole memory."""
        return self.peak_memory_bytes / self.gpu_memory_bytes


@dataclass(frozen=True)
class Thresholds:
    """The user's limits (--min-mfu, --max-memory-fraction); None: not asked for."""

    min_mfu: float | None = None
    max_memory_fraction: float | None = None


@dataclass(frozen=True)
class FitRule:
    """`code`: the search's reason code (`plan3d.search.REASONS`); `threshold`: the `Thresholds`
    field that switches the rule on (None: always on), passed to `fails` and `sentence` as `limit`."""

    code: int
    reason: str
    threshold: str | None
    fails: Callable[[FitFacts, float | None], Any]
    sentence: Callable[[FitFacts, float | None], str]
    fix: str


def _over_capacity(x: FitFacts, _limit) -> str:
    return (f"predicted peak memory {x.peak_memory_bytes / 2**30:.1f} GiB per GPU exceeds the "
            f"{x.capacity_bytes / 2**30:.1f} GiB usable (GPU memory less headroom and reserve)")


def _over_fraction(x: FitFacts, limit: float) -> str:
    return (f"predicted peak memory is {x.memory_fraction:.1%} of the GPU's memory, "
            f"above --max-memory-fraction {limit:.1%}")


FIT_RULES = (
    FitRule(10, "does not fit in GPU memory with headroom", None, lambda x, _: np.logical_not(x.fits),
            _over_capacity, "lower memory: see the changes below, or run `plan3d recommend` for this job"),
    FitRule(11, "below the --min-mfu threshold", "min_mfu", lambda x, limit: x.mfu < limit,
            lambda x, limit: f"predicted MFU {x.mfu:.1%} is below --min-mfu {limit:.1%}",
            "use the recommended layout below, or lower the threshold"),
    FitRule(12, "above the --max-memory-fraction threshold", "max_memory_fraction",
            lambda x, limit: x.memory_fraction > limit, _over_fraction,
            "shard more (ZeRO, pp) or recompute; see the changes below"),
)


def active_rules(thresholds: Thresholds) -> list[tuple[FitRule, float | None]]:
    """The rules in force, in table order, each with its limit (None for the always-on memory rule)."""
    limits = [(rule, None if rule.threshold is None else getattr(thresholds, rule.threshold)) for rule in FIT_RULES]
    return [(rule, limit) for rule, limit in limits if rule.threshold is None or limit is not None]


def fit_codes(facts: FitFacts, n: int, thresholds: Thresholds) -> np.ndarray:
    """Per prediction of `facts` (arrays of length n): 0, or the code of the first rule it fails."""
    codes = np.zeros(n, dtype=np.int8)
    if not n:
        return codes
    for rule, limit in active_rules(thresholds):
        codes[(codes == 0) & rule.fails(facts, limit)] = rule.code
    return codes


def broken_fit_rules(facts: FitFacts, thresholds: Thresholds) -> list[tuple[FitRule, str]]:
    """Every rule one prediction fails, in table order, with its sentence."""
    return [(rule, rule.sentence(facts, limit)) for rule, limit in active_rules(thresholds)
            if rule.fails(facts, limit)]
