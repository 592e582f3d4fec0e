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
from a second generator over the same ranks with axes etp, ep, dp' = tp*cp*dp/(ep*etp), pp (cp
dropped; etp = tp unless the layout sets it: MoE Parallel Folding), in the layout's order.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from functools import cached_property, lru_cache

import numpy as np

from plan3d.errors import LayoutError
from plan3d.layout import Layout
from plan3d.specs.cluster import ResolvedTier
from plan3d.specs.loader import MAX_VALUES


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


# The dense group kinds and the axes each spans; `RankMap` adds "embedding", "ep" and "edp".
DENSE_GROUPS = {"tp": ("tp",), "cp": ("cp",), "dp": ("dp",), "pp": ("pp",),
                "dp_cp": ("cp", "dp"), "tp_cp": ("tp", "cp"), "mp": ("tp", "pp")}


def group_shapes(layout: Layout) -> dict[str, tuple[int, int]]:
    """(groups, members per group) of every group kind of `layout`'s rank map, without building it."""
    world, sizes = layout.world_size, {"tp": layout.tp, "cp": layout.cp, "dp": layout.dp, "pp": layout.pp}
    members = {name: int(np.prod([sizes[a] for a in axes])) for name, axes in DENSE_GROUPS.items()}
    members |= {"ep": layout.ep, "edp": layout.expert_dp}
    if layout.etp is not None:
        members["etp"] = layout.etp
    shapes = {name: (world // size, size) for name, size in members.items()}
    return shapes | {"embedding": (world // layout.pp, 2 if layout.pp > 1 else 1)}  # first and last stage


def innermost_tier(groups, tiers) -> int:
    """Index of the innermost of `tiers` (inner to outer) whose domains each hold a whole group:
    rank r lies in domain r // domain_gpus of a tier. `groups`: equal-size rows of ranks. The
    outermost tier when none does (it carries everything). The tier a rank map's group crosses and
    the tier `plan3d calibrate` files a measured group under are this one rule."""
    groups = np.asarray(groups)
    for index, tier in enumerate(tiers):
        domains = groups // tier.domain_gpus
        if (domains.min(axis=1) == domains.max(axis=1)).all():
            return index
    return len(tiers) - 1


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
        out = {name: _axis_groups(self._sizes, self._axes, axes) for name, axes in DENSE_GROUPS.items()}
        out["embedding"] = self._embedding_groups(out["pp"])
        out.update(self._expert_groups())
        return out

    def _embedding_groups(self, pp_groups: np.ndarray) -> np.ndarray:
        """First and last stage of each pipeline (they share the tied embedding's gradient)."""
        return pp_groups[:, [0, -1]] if self.layout.pp > 1 else pp_groups

    def _expert_groups(self) -> dict[str, np.ndarray]:
        """Megatron-Core's expert RankGenerator over the same ranks: axes etp, ep, edp, pp in the
        layout's order (tp's place taken by etp, cp's folded into edp)."""
        layout = self.layout
        sizes = {"tp": layout.expert_tp, "cp": 1, "ep": layout.ep, "pp": layout.pp, "dp": layout.expert_dp}
        groups = {"ep": _axis_groups(sizes, self._axes, ("ep",)), "edp": _axis_groups(sizes, self._axes, ("dp",))}
        if layout.etp is not None:
            groups["etp"] = _axis_groups(sizes, self._axes, ("tp",))
        return groups

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
        ep_groups = self.group_array("ep")
        table[ep_groups, 2] = np.arange(ep_groups.shape[1])  # a rank's ep coordinate: its place in its ep group
        return table

    def coords(self, rank: int) -> RankCoord:
        if not 0 <= rank < self.world_size:
            raise IndexError(f"rank {rank} outside world of {self.world_size}")
        tp, cp, ep, dp, pp = (int(v) for v in self._coord_table[rank])
        return RankCoord(rank, rank // self.gpus_per_node, rank % self.gpus_per_node, tp, cp, ep, dp, pp)

    def all_coords(self, limit: int | None = None) -> list[RankCoord]:
        """Coordinates of ranks 0, 1, ... (the first `limit` of them when given); one numpy pass,
        not one `coords` call per rank (a million ranks: 1 s instead of 12 s)."""
        count = self.world_size if limit is None else min(limit, self.world_size)
        gpn, ranks = self.gpus_per_node, range(count)
        rows = self._coord_table[:count].tolist()
        return [RankCoord(r, r // gpn, r % gpn, tp, cp, ep, dp, pp) for r, (tp, cp, ep, dp, pp) in zip(ranks, rows)]

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
        """Index of the innermost tier whose domains each hold a whole group of `name` (`innermost_tier`)."""
        return innermost_tier(self.group_array(name), tiers)

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
    shape = Layout(tp=layout.tp, pp=layout.pp, dp=layout.dp, cp=layout.cp, ep=layout.ep, etp=layout.etp,
                   order=layout.order)
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


def rankmap_json_values(layout: Layout) -> int:
    """How many JSON values `plan3d.plan.rankmap_dict` of `layout` holds, counted as the plan loader
    counts them (a list or mapping is one value plus its items), without building it.

    One mapping of order, world size and GPUs per node; one mapping of 8 fields per rank; per group
    kind, a list of world/size groups of `size` members."""
    world, per_rank = layout.world_size, 1 + len(fields(RankCoord))
    groups = sum(1 + count * (1 + size) for count, size in group_shapes(layout).values())
    return 1 + 3 + (1 + world * per_rank) + (1 + groups)


MAX_LISTED_RANKS = 131_072  # a listing of every rank (rankmap json/csv, a plan): the largest real clusters
MAX_PLAN_RANKS = 32_768  # a plan file is re-checked whole on every load: 16,384 ranks load in ~2 s, 131,072 in ~14 s
PLAN_OTHER_VALUES = 100_000  # what a plan holds besides its rank map (specs, estimate): a few hundred values


def require_loadable_plan(layout: Layout) -> None:
    """Refuse, before building it, a plan listing more than MAX_PLAN_RANKS ranks (every load re-checks
    the whole rank map: 16,384 ranks take ~2 s, 131,072 ~14 s) or one whose rank map the plan loader would refuse (it reads at most
    `plan3d.specs.loader.MAX_VALUES` JSON values per file; 625,000 ranks take 23 s and 220 MB)."""

    if layout.world_size > MAX_PLAN_RANKS:
        raise LayoutError(f"--out: the plan of {layout.short()} would list {layout.world_size:,} ranks, more than a "
                          f"plan lists (at most {MAX_PLAN_RANKS:,}, so that loading it stays within seconds); use "
                          "fewer --nodes or drop --out and read the table")
    values = rankmap_json_values(layout)
    if values + PLAN_OTHER_VALUES > MAX_VALUES:
        per_rank = values / layout.world_size
        fits = int((MAX_VALUES - PLAN_OTHER_VALUES) / per_rank)
        raise LayoutError(f"--out: the plan of {layout.short()} lists {layout.world_size:,} ranks ({values:,} values), "
                          f"more than a plan file may hold ({MAX_VALUES:,} values), so emit and launch could not read "
                          f"it; use fewer --nodes (about {fits:,} ranks fit) or drop --out")
