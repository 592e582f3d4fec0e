"""Layout values as float arrays, so one formula serves one layout and 10^5 layouts alike."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from plan3d.vocab import RECOMPUTE_CODES  # noqa: F401  (re-exported: the codes of `recompute` below)


@dataclass(frozen=True)
class LayoutArrays:
    """Broadcastable float arrays of layout values; `m` = micro-batches per pipeline per step."""

    tp: np.ndarray
    pp: np.ndarray
    dp: np.ndarray
    mb: np.ndarray
    vpp: np.ndarray
    zero: np.ndarray
    recompute: np.ndarray  # plan3d.vocab.RECOMPUTE_CODES: 0 none, 1 selective, 2 full
    sp: np.ndarray  # 1.0 with sequence parallelism
    m: np.ndarray

    @property
    def sp_div(self) -> np.ndarray:
        """What sequence parallelism divides the replicated activations by: tp with it, else 1."""
        return np.where(self.sp > 0, self.tp, 1.0)


def layout_arrays(global_batch: int, tp, pp, dp, mb, vpp, zero, recompute, sp) -> LayoutArrays:
    f = lambda x: np.asarray(x, dtype=np.float64)  # noqa: E731
    m = global_batch // (np.asarray(mb, dtype=np.int64) * np.asarray(dp, dtype=np.int64))
    return LayoutArrays(f(tp), f(pp), f(dp), f(mb), f(vpp), f(zero), f(recompute), f(sp), f(m))
