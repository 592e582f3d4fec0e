"""`estimate_batch()`: the same estimate for many candidate layouts at once (for the search).

Candidates are assumed valid (the search filters them with layout_problems' rules). Their layer
split is even, or given per pipeline rank (`rank_layers`, uneven splits); each result equals
`estimate()` of the same layout (tests check 1e-9 agreement).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from plan3d.cost.arrays import layout_arrays
from plan3d.cost.comm import layout_links
from plan3d.cost.context import make_context
from plan3d.cost.core import Links, evaluate, link_row
from plan3d.cost.finite import require_finite
from plan3d.cost.memory import chunk_moe_layers
from plan3d.specs import schedule as schedules
from plan3d.specs.cluster import ClusterSpec
from plan3d.specs.engine import EngineSpec
from plan3d.specs.model import ModelSpec
from plan3d.specs.training import TrainingSpec
from plan3d.vocab import UTILISATION


@dataclass(frozen=True)
class Candidates:
    """Equal-length arrays, one entry per candidate layout."""

    tp: np.ndarray
    pp: np.ndarray
    dp: np.ndarray
    micro_batch: np.ndarray
    vpp: np.ndarray
    zero: np.ndarray
    recompute: np.ndarray  # plan3d.vocab.RECOMPUTE_CODES of each candidate
    sequence_parallel: np.ndarray  # bool
    order: np.ndarray  # index into the `orders` tuple
    cp: np.ndarray | None = None  # context parallel degree (None: 1 for every candidate)
    ep: np.ndarray | None = None  # expert parallel degree (None: 1 for every candidate)
    etp: np.ndarray | None = None  # expert tensor-parallel degree (None: tp for every candidate)
    schedule: np.ndarray | None = None  # pipeline schedule codes (None: the default for each vpp)

    def __len__(self) -> int:
        return len(self.tp)

    @property
    def cp_degrees(self) -> np.ndarray:
        return np.ones(len(self.tp), dtype=np.int64) if self.cp is None else np.asarray(self.cp, dtype=np.int64)

    @property
    def ep_degrees(self) -> np.ndarray:
        return np.ones(len(self.tp), dtype=np.int64) if self.ep is None else np.asarray(self.ep, dtype=np.int64)

    @property
    def etp_degrees(self) -> np.ndarray:
        return np.asarray(self.tp if self.etp is None else self.etp, dtype=np.int64)


def _links(cluster: ClusterSpec, cands: Candidates, orders: tuple[str, ...]) -> Links:
    """Bandwidth and latency arrays of each group, one rank-map look-up per unique shape."""
    columns = [np.asarray(x, dtype=np.int64)
               for x in (cands.tp, cands.pp, cands.dp, cands.order, cands.cp_degrees, cands.ep_degrees,
                         cands.etp_degrees)]
    key = np.zeros(len(columns[0]), dtype=np.int64)
    for col in columns:  # mixed-radix code: a 1-D unique is ~100x faster than unique(axis=0)
        key = key * (int(col.max()) + 1) + col
    _, first, inverse = np.unique(key, return_index=True, return_inverse=True)
    unique = np.stack([col[first] for col in columns], axis=1)
    tiers = tuple(cluster.tiers())
    table = np.array([link_row(layout_links(tp, pp, dp, orders[order], tiers, cluster.gpus_per_node, cp, ep,
                                            None if etp == tp else etp))
                      for tp, pp, dp, order, cp, ep, etp in unique.tolist()], dtype=np.float64)
    return Links.from_rows(table[inverse.reshape(-1)])


def even_stages(pp: np.ndarray, layers: int):
    """The three stage kinds of an even split, first / middle / last, with their multiplicities."""
    pp_rank = np.stack([np.zeros_like(pp), np.ones_like(pp), pp - 1])
    weights = np.stack([np.ones_like(pp), np.maximum(pp - 2, 0), (pp > 1).astype(np.float64)])
    return pp_rank, np.broadcast_to(layers / pp, pp_rank.shape), weights


def listed_stages(pp: np.ndarray, rank_layers: np.ndarray):
    """Every pipeline rank of each candidate, as `estimate()` stacks them (padding rows weigh 0)."""
    rank_layers = np.asarray(rank_layers, dtype=np.float64)
    pp_rank = np.broadcast_to(np.arange(rank_layers.shape[0], dtype=np.float64)[:, None], rank_layers.shape)
    return pp_rank, rank_layers, (pp_rank < pp).astype(np.float64)


def even_moe_rank_layers(model: ModelSpec, pp: np.ndarray, vpp: np.ndarray,
                         v_shape: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(P, n) layers and MoE layers on each pipeline rank of each candidate's even split (chunks
    placed as its schedule places them, `v_shape`): an MoE model's stages differ (first dense
    layers, one MoE layer every n), so every rank is listed."""
    pp, vpp = np.asarray(pp, dtype=np.int64), np.asarray(vpp, dtype=np.int64)
    v_shape = np.zeros(len(pp), dtype=bool) if v_shape is None else np.asarray(v_shape, dtype=bool)
    rows = int(pp.max()) if len(pp) else 1
    layers, moe = np.zeros((rows, len(pp))), np.zeros((rows, len(pp)))
    for p, v, shape in {(int(a), int(b), bool(c)) for a, b, c in zip(pp, vpp, v_shape)}:
        chunks = (model.layers // (p * v),) * (p * v)
        hit = (pp == p) & (vpp == v) & (v_shape == shape)
        layers[:p, hit] = np.array(schedules.per_rank(chunks, p, shape))[:, None]
        moe[:p, hit] = np.array(schedules.per_rank(chunk_moe_layers(model, chunks), p, shape))[:, None]
    return layers, moe


def _same_on_every_rank(per_rank: np.ndarray, pp: np.ndarray) -> bool:
    """Whether every candidate holds as many MoE layers on each of its pipeline ranks."""
    valid = np.arange(per_rank.shape[0])[:, None] < pp[None, :]
    return bool(np.all(np.where(valid, per_rank, per_rank[0]) == per_rank[0]))


def estimate_batch(cluster: ClusterSpec, model: ModelSpec, training: TrainingSpec, cands: Candidates,
                   orders: tuple[str, ...], engine: EngineSpec | None = None,
                   rank_layers: np.ndarray | None = None,
                   rank_moe_layers: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """Step time, throughput, memory and breakdown for every candidate (arrays), as `engine` runs
    them (candidates are assumed to be layouts the engine can run).

    `rank_layers` (P, n): layers on pipeline rank r of candidate i (rows r >= its pp are ignored),
    for uneven splits; None: every candidate splits its layers evenly. `rank_moe_layers` (P, n):
    the MoE layers among them (an MoE model with `rank_layers` needs it)."""
    ctx = make_context(cluster, model, training, engine)
    la = layout_arrays(training.global_batch, cands.tp, cands.pp, cands.dp, cands.micro_batch, cands.vpp,
                       cands.zero, cands.recompute, np.asarray(cands.sequence_parallel, dtype=np.float64),
                       cands.cp_degrees, cands.ep_degrees, cands.etp, cands.schedule)
    moe_layers = 0.0
    if model.moe is not None:
        even = rank_layers is None
        if even:
            rank_layers, rank_moe_layers = even_moe_rank_layers(model, cands.pp, cands.vpp, la.v_shape)
        moe_layers = np.asarray(rank_moe_layers, dtype=np.float64)
        if even and _same_on_every_rank(moe_layers, la.pp):  # e.g. every layer an MoE layer: three stage kinds do
            pp_rank, layers, weights = even_stages(la.pp, model.layers)
            moe_layers = np.broadcast_to(moe_layers[0], layers.shape)
        else:
            pp_rank, layers, weights = listed_stages(la.pp, rank_layers)
    elif rank_layers is None:
        pp_rank, layers, weights = even_stages(la.pp, model.layers)
    else:
        pp_rank, layers, weights = listed_stages(la.pp, rank_layers)
    out = evaluate(ctx, la, _links(cluster, cands, orders), pp_rank, layers, weights, moe_layers)
    time = out["time_s"]
    result = {k: out[k] for k in ("step_time_s", "tokens_per_s", "peak_memory_bytes", "capacity_bytes",
                                  *UTILISATION, "model_tflops_per_gpu", "bubble_fraction", "recompute_layers")}
    result["fits"] = out["peak_memory_bytes"] <= out["capacity_bytes"]
    result.update({f"{k}_s": time[k] for k in time})
    require_finite(result, cluster, model, training, engine)
    return result
