"""Rank map: global rank <-> (tp, cp, ep, dp, pp) coordinates <-> node and local GPU.

Convention (Megatron-LM's `RankGenerator`): the order string lists the axes, the FIRST varies
fastest. With the default ``tp-cp-ep-dp-pp`` (cp = ep = 1) and tp=2, dp=2, pp=2 on 8 GPUs::

    rank = tp_rank + 2 * dp_rank + 4 * pp_rank
    tp groups: [0, 1] [2, 3] [4, 5] [6, 7]
    dp groups: [0, 2] [1, 3] [4, 6] [5, 7]
    pp groups: [0, 4] [1, 5] [2, 6] [3, 7]

A group of axis X holds the ranks that differ only in X. Groups are listed with the other axes
enumerated in order (fastest first) and members sorted by their X coordinate, exactly as
Megatron-LM's `generate_masked_orthogonal_rank_groups` lists them.

Placement: rank r runs on node r // gpus_per_node, local GPU r % gpus_per_node. The launcher must
make that true (static rendezvous) and the runtime checks it.

Expert parallelism follows Megatron-LM: the dense axes are tp, cp, dp, pp; the expert groups come
from a second generator over the same ranks with axes tp, ep, dp' = dp*cp/ep, pp (cp dropped).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property, lru_cache

import numpy as np

from plan3d.layout import Layout
from plan3d.specs.cluster import ResolvedTier


@dataclass(frozen=True)
class RankCoord:
    rank: int
    node: int
    local_rank: int
    tp: int
    cp: int
    ep: int
    dp: int
    pp: int


def _grid(sizes: dict[str, int], axes: tuple[str, ...]) -> np.ndarray:
    """Array of ranks indexed [coord of axes[-1], ..., coord of axes[0]] (first axis fastest)."""
    world = int(np.prod([sizes[a] for a in axes]))
    return np.arange(world).reshape([sizes[a] for a in reversed(axes)])


def _axis_groups(sizes: dict[str, int], axes: tuple[str, ...], names: tuple[str, ...]) -> np.ndarray:
    """Groups (rows) of the ranks that differ only along `names`, in Megatron's listing order."""
    grid = _grid(sizes, axes)
    dims = {a: len(axes) - 1 - i for i, a in enumerate(axes)}
    varying = [dims[n] for n in reversed([a for a in axes if a in names])]  # slowest first
    fixed = [dims[a] for a in reversed(axes) if a not in names]  # slowest first
    group_size = int(np.prod([sizes[n] for n in names])) if names else 1
    return grid.transpose(fixed + varying).reshape(-1, group_size)


class RankMap:
    """Every rank's coordinates and placement, and the member lists of every group."""

    def __init__(self, layout: Layout, gpus_per_node: int):
        self.layout = layout
        self.gpus_per_node = gpus_per_node
        self.order = layout.order
        self.world_size = layout.world_size
        self._axes = tuple(a for a in layout.axes)
        self._sizes = {"tp": layout.tp, "cp": layout.cp, "ep": 1, "dp": layout.dp, "pp": layout.pp}

    # ---- groups -------------------------------------------------------------------------
    def group_array(self, name: str) -> np.ndarray:
        """Groups of `name` as a (groups, members) int array."""
        return self._group_arrays[name]

    def groups(self, name: str) -> list[list[int]]:
        return self.group_array(name).tolist()

    @property
    def group_names(self) -> tuple[str, ...]:
        return tuple(self._group_arrays)

    @cached_property
    def _group_arrays(self) -> dict[str, np.ndarray]:
        dense = {
            "tp": ("tp",), "cp": ("cp",), "dp": ("dp",), "pp": ("pp",),
            "dp_cp": ("cp", "dp"), "tp_cp": ("tp", "cp"), "mp": ("tp", "pp"),
        }
        out = {name: _axis_groups(self._sizes, self._axes, axes) for name, axes in dense.items()}
        out["embedding"] = self._embedding_groups(out["pp"])
        out.update(self._expert_groups())
        return out

    def _embedding_groups(self, pp_groups: np.ndarray) -> np.ndarray:
        """First and last stage of each pipeline (they share the tied embedding's gradient)."""
        return pp_groups[:, [0, -1]] if self.layout.pp > 1 else pp_groups

    def _expert_groups(self) -> dict[str, np.ndarray]:
        ep = self.layout.ep
        sizes = {"tp": self.layout.tp, "cp": 1, "ep": ep, "pp": self.layout.pp,
                 "dp": self.layout.dp * self.layout.cp // ep}
        return {"ep": _axis_groups(sizes, self._axes, ("ep",)),
                "edp": _axis_groups(sizes, self._axes, ("dp",))}

    # ---- coordinates ----------------------------------------------------------------------
    @cached_property
    def _coord_table(self) -> np.ndarray:
        """(world, 5) array of (tp, cp, ep, dp, pp) per rank."""
        table = np.zeros((self.world_size, 5), dtype=np.int64)
        stride = 1
        for axis in self._axes:
            size = self._sizes[axis]
            table[:, "tp cp ep dp pp".split().index(axis)] = (np.arange(self.world_size) // stride) % size
            stride *= size
        ep_row = np.empty(self.world_size, dtype=np.int64)
        for index, members in enumerate(self.group_array("ep")):
            ep_row[members] = np.arange(len(members))
        table[:, 2] = ep_row
        return table

    def coords(self, rank: int) -> RankCoord:
        if not 0 <= rank < self.world_size:
            raise IndexError(f"rank {rank} outside world of {self.world_size}")
        tp, cp, ep, dp, pp = (int(v) for v in self._coord_table[rank])
        return RankCoord(rank, rank // self.gpus_per_node, rank % self.gpus_per_node, tp, cp, ep, dp, pp)

    def all_coords(self) -> list[RankCoord]:
        return [self.coords(r) for r in range(self.world_size)]

    def rank_of(self, tp: int = 0, pp: int = 0, dp: int = 0, cp: int = 0) -> int:
        coord = {"tp": tp, "cp": cp, "ep": 0, "dp": dp, "pp": pp}
        rank, stride = 0, 1
        for axis in self._axes:
            rank += coord[axis] * stride
            stride *= self._sizes[axis]
        return rank

    # ---- placement facts ------------------------------------------------------------------
    def nodes_spanned(self, name: str) -> int:
        """Most nodes any one group of `name` touches."""
        nodes = np.sort(self.group_array(name) // self.gpus_per_node, axis=1)
        return int((np.diff(nodes, axis=1) != 0).sum(axis=1).max()) + 1

    def tier_index(self, name: str, tiers: list[ResolvedTier]) -> int:
        """Index of the innermost tier whose domains each hold a whole group of `name`."""
        groups = self.group_array(name)
        for index, tier in enumerate(tiers):
            domains = groups // tier.domain_gpus
            if (domains.min(axis=1) == domains.max(axis=1)).all():
                return index
        return len(tiers) - 1

    def warnings(self, tiers: list[ResolvedTier] | None = None) -> list[str]:
        """Placement warnings; with the cluster's tiers, only those that leave the fast domain
        (a TP group over two trays of one GB200 NVL72 rack is fine), see `placement_warnings`."""
        if tiers is not None:
            return placement_warnings(self, tiers)
        out = []
        tp_nodes = self.nodes_spanned("tp")
        if self.layout.tp > 1 and tp_nodes > 1:
            out.append(f"TP group spans {tp_nodes} nodes: TP traffic leaves the node's fast link; "
                       f"keep tp <= gpus_per_node ({self.gpus_per_node}) with tp first in the order")
        return out


def rankmap_for(layout: Layout, gpus_per_node: int) -> RankMap:
    """Cached RankMap. The map depends only on the degrees and the order, so layouts that differ
    in micro-batch, ZeRO or recompute share one (the search asks for the same shapes many times)."""
    shape = Layout(tp=layout.tp, pp=layout.pp, dp=layout.dp, cp=layout.cp, ep=layout.ep, order=layout.order)
    return _rankmap_for_shape(shape, gpus_per_node)


@lru_cache(maxsize=4096)
def _rankmap_for_shape(shape: Layout, gpus_per_node: int) -> RankMap:
    return RankMap(shape, gpus_per_node)


@dataclass(frozen=True)
class GroupPlacement:
    """Where the groups of one kind sit: size, count, nodes touched and the tier that carries them."""

    name: str
    size: int
    count: int
    nodes_spanned: int
    tier_index: int
    tier_name: str


def placements(rankmap: RankMap, tiers: list[ResolvedTier]) -> list[GroupPlacement]:
    """Placement facts of every group kind of `rankmap` on a cluster with `tiers` (inner to outer)."""
    out = []
    for name in rankmap.group_names:
        groups = rankmap.group_array(name)
        tier = rankmap.tier_index(name, tiers)
        out.append(GroupPlacement(name, groups.shape[1], groups.shape[0], rankmap.nodes_spanned(name),
                                  tier, tiers[tier].name))
    return out


def placement_warnings(rankmap: RankMap, tiers: list[ResolvedTier]) -> list[str]:
    """Warnings for latency-critical groups (tp, cp) that leave the innermost tier.

    Unlike `RankMap.warnings`, this knows the tiers: a TP group spread over two 4-GPU trays of
    one GB200 NVL72 rack still rides NVLink, so it is not flagged.
    """
    out = []
    for name in ("tp", "cp"):
        size = rankmap.group_array(name).shape[1]
        tier = rankmap.tier_index(name, tiers)
        if size > 1 and tier > 0:
            nodes = rankmap.nodes_spanned(name)
            out.append(f"{name.upper()} group spans {nodes} nodes and runs over {tiers[tier].name!r} instead of "
                       f"{tiers[0].name!r}: keep {name} <= {tiers[0].domain_gpus} GPUs and {name} early in the order")
    return out
