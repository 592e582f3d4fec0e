"""Process groups and the DeviceMesh of a run, built FROM the plan's rank map (never re-derived).

The mesh is a (pp, dp, tp) array whose cell [p, d, t] is the rank the plan placed at those
coordinates, so any `order` of the plan (tp-dp-pp, tp-pp-dp, ...) gives the plan's own groups.
With context parallelism (cp > 1) it is (pp, dp, cp, tp), and its (dp, cp) dimensions are also
flattened into one "dp_cp" mesh: the gradient reduction and the ZeRO shards span dp x cp
(`runtime/cp.py`). With cp == 1 no cp dimension is made and dp_cp is the dp dimension itself.
A model with MoE layers also gets a second mesh, (pp, edp, ep, tp), from the rank map's "ep" and
"edp" groups (Megatron-Core folds ep out of dp x cp; edp = dp*cp/ep ranks hold the same experts):
the experts' all-to-all runs on its ep dimension, their gradients and ZeRO shards on edp, and
their checkpoint tensors live on its (edp, tp) sub-mesh.
One `ParallelContext` object is passed around; there are no module-level group globals.
"""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from plan3d.errors import LaunchError
from plan3d.plan import RankMapRecord
from plan3d.runtime.cp import CPInfo
from plan3d.runtime.moe import EPInfo
from plan3d.runtime.tp import TPInfo

MESH_DIMS = ("pp", "dp", "tp")
CP_MESH_DIMS = ("pp", "dp", "cp", "tp")
DP_CP = "dp_cp"
EXPERT_MESH_DIMS = ("pp", "edp", "ep", "tp")


@dataclass(frozen=True)
class Replicas:
    """The ranks that hold the same copy of a set of parameters: their gradients are summed over
    `group` (None: this rank alone) and divided by `divisor`, the data-parallel replicas of the
    batch (dp x cp: an expert's gradient already sums the tokens its ep group sent it)."""

    size: int
    rank: int
    group: object | None
    divisor: int


def mesh_dims(layout) -> tuple[str, ...]:
    """The mesh's dimension names: a cp dimension only when cp > 1."""
    return CP_MESH_DIMS if layout.cp > 1 else MESH_DIMS


def mesh_array(rankmap: RankMapRecord, layout) -> torch.Tensor:
    """[pp, dp, tp] (cp > 1: [pp, dp, cp, tp]) tensor of global ranks, from the plan's per-rank
    coordinates."""
    dims = mesh_dims(layout)
    mesh = torch.full(tuple(getattr(layout, d) for d in dims), -1, dtype=torch.int64)
    for r in rankmap.ranks:
        mesh[tuple(r.get(d, 0) for d in dims)] = r["rank"]
    assert (mesh >= 0).all(), f"rank map does not cover the {dims} grid"
    return mesh


@dataclass
class ParallelContext:
    rank: int
    world: int
    mesh: DeviceMesh
    coords: dict
    device: torch.device
    tp: TPInfo
    embedding_group: object | None = None
    sizes: dict = field(default_factory=dict)
    cp: CPInfo = field(default_factory=CPInfo)
    flat_dp_cp: DeviceMesh | None = None  # the flattened (dp, cp) mesh when cp > 1
    ep: EPInfo = field(default_factory=EPInfo)
    expert_mesh: DeviceMesh | None = None  # (pp, edp, ep, tp) when the model has MoE layers

    def replicas(self, expert: bool = False) -> Replicas:
        """Who reduces a parameter's gradient and shares its ZeRO shards: dp x cp for the dense
        parameters, the expert-data-parallel group for a routed expert's."""
        if not expert or self.expert_mesh is None:
            size = self.dp_cp_size
            return Replicas(size, self.dp_cp_rank, self.group(DP_CP) if size > 1 else None, size)
        size = self.expert_mesh.size(EXPERT_MESH_DIMS.index("edp"))
        group = self.expert_mesh.get_group("edp") if size > 1 else None
        return Replicas(size, self.expert_mesh.get_local_rank("edp"), group, self.dp_cp_size)

    def group(self, dim: str):
        if dim == DP_CP:
            return self.dp_cp_mesh.get_group()
        return self.mesh.get_group(dim)

    @property
    def dp_cp_size(self) -> int:
        """Ranks that hold the same parameters and reduce gradients together: dp x cp."""
        return self.sizes["dp"] * self.cp.size

    @property
    def dp_cp_rank(self) -> int:
        return self.flat_dp_cp.get_local_rank() if self.flat_dp_cp is not None else self.coords["dp"]

    @property
    def dp_cp_mesh(self) -> DeviceMesh:
        """1-D mesh of this rank's dp x cp group (FSDP2 shards over it)."""
        return self.flat_dp_cp if self.flat_dp_cp is not None else self.mesh["dp"]

    def local(self, dim: str) -> int:
        return self.coords[dim]

    @property
    def is_first_pp(self) -> bool:
        return self.coords["pp"] == 0

    @property
    def is_last_pp(self) -> bool:
        return self.coords["pp"] == self.sizes["pp"] - 1


def _embedding_group(plan, rank: int, timeout: timedelta):
    """new_group for every embedding group (all ranks must call), return this rank's."""
    mine = None
    if plan.layout.pp == 1 or not plan.model.tied_embeddings:
        return None
    for members in plan.rankmap.groups["embedding"]:
        group = dist.new_group(members, timeout=timeout)
        mine = group if rank in members else mine
    return mine


def group_options(backend: str, timeout: timedelta):
    """Backend options that carry the collective timeout into every group the DeviceMesh makes.

    Without them `DeviceMesh` creates its tp/pp/dp groups with `timeout=None`, i.e. torch's
    default of 30 minutes, whatever `init_process_group` was given: a hung rank then holds a 3D
    job for half an hour (the pipeline's p2p runs on the pp group, so it inherits this too)."""
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options.is_high_priority_stream = False
        options._timeout = timeout
        return options
    return torch._C._distributed_c10d.Backend.Options(backend, timeout)


def expert_mesh_array(rankmap: RankMapRecord, layout) -> torch.Tensor:
    """[pp, edp, ep, tp] tensor of global ranks: a rank's edp coordinate is its place in its
    "edp" group, its ep coordinate the rank map's (its place in its "ep" group)."""
    edp = layout.dp * layout.cp // layout.ep
    mesh = torch.full((layout.pp, edp, layout.ep, layout.tp), -1, dtype=torch.int64)
    place = {rank: i for group in rankmap.groups["edp"] for i, rank in enumerate(group)}
    for r in rankmap.ranks:
        mesh[r.get("pp", 0), place[r["rank"]], r.get("ep", 0), r.get("tp", 0)] = r["rank"]
    assert (mesh >= 0).all(), "rank map does not cover the (pp, edp, ep, tp) grid"
    return mesh


def build_expert_mesh(plan, device: torch.device, timeout: timedelta) -> DeviceMesh:
    backend = dist.get_backend()
    override = tuple((backend, group_options(backend, timeout)) for _ in EXPERT_MESH_DIMS)
    return DeviceMesh(device.type, expert_mesh_array(plan.rankmap, plan.layout), mesh_dim_names=EXPERT_MESH_DIMS,
                      backend_override=override)


def build_mesh(plan, device: torch.device, timeout: timedelta) -> DeviceMesh:
    """The (pp, dp, tp) (cp > 1: (pp, dp, cp, tp)) DeviceMesh of the plan's rank map; every
    dimension's groups time out after `timeout`, like the world group."""
    backend, dims = dist.get_backend(), mesh_dims(plan.layout)
    override = tuple((backend, group_options(backend, timeout)) for _ in dims)
    return DeviceMesh(device.type, mesh_array(plan.rankmap, plan.layout), mesh_dim_names=dims,
                      backend_override=override)


def flatten_dp_cp(mesh: DeviceMesh, backend_override) -> DeviceMesh:
    """The (dp, cp) dimensions as one mesh, dp slowest (the rank map's dp_cp group order), as
    torchtitan 0.3 flattens its ("batch", "cp") loss mesh (`distributed/parallel_dims.py`).
    `backend_override`: (backend, options) of its group, as `build_mesh` gives each dimension."""
    return mesh["dp", "cp"]._flatten(DP_CP, backend_override=backend_override)


def build_context(plan, device: torch.device, timeout: timedelta) -> ParallelContext:
    """After init_process_group: the mesh, this rank's coordinates, tp facts, embedding group."""
    layout, rank = plan.layout, dist.get_rank()
    mesh = build_mesh(plan, device, timeout)
    coords = dict(plan.rankmap.ranks[rank])
    sizes = {"pp": layout.pp, "dp": layout.dp, "tp": layout.tp, "cp": layout.cp}
    tp = TPInfo(layout.tp, coords["tp"], mesh.get_group("tp") if layout.tp > 1 else None,
                layout.sequence_parallel)
    cp = CPInfo(layout.cp, coords.get("cp", 0), mesh.get_group("cp") if layout.cp > 1 else None, plan.cp_comm)
    backend = dist.get_backend()
    flat = flatten_dp_cp(mesh, (backend, group_options(backend, timeout))) if layout.cp > 1 else None
    experts = build_expert_mesh(plan, device, timeout) if plan.model.moe is not None else None
    ep_group = experts.get_group("ep") if layout.ep > 1 else None
    # this rank's place in its ep group as the all-to-all numbers it (its experts follow from it)
    ep = EPInfo(layout.ep, dist.get_rank(ep_group) if ep_group is not None else 0, ep_group)
    return ParallelContext(rank, dist.get_world_size(), mesh, coords, device, tp,
                           _embedding_group(plan, rank, timeout), sizes, cp, flat, ep, experts)


def placement_problems(plan, placements: list[dict]) -> list[str]:
    """Ranks whose actual (node, local rank) differ from the plan's rank map."""
    problems = []
    for got in placements:
        want = plan.rankmap.ranks[got["rank"]]
        if (got["node"], got["local_rank"]) != (want["node"], want["local_rank"]):
            problems.append(f"rank {got['rank']} runs on node {got['node']} local rank {got['local_rank']} "
                            f"({got['host']}), the plan puts it on node {want['node']} local rank {want['local_rank']}")
    return problems


def my_placement() -> dict:
    """This process's placement: node from the launcher (PLAN3D_NODE_RANK), local rank from torchrun."""
    node = os.environ.get("PLAN3D_NODE_RANK", os.environ.get("GROUP_RANK", "0"))
    return {"rank": int(os.environ["RANK"]), "node": int(node), "local_rank": int(os.environ["LOCAL_RANK"]),
            "host": socket.gethostname()}


def check_placement(plan) -> None:
    """Every rank reports its placement; on any mismatch the whole job stops with one message."""
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, my_placement())
    problems = placement_problems(plan, gathered)
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise LaunchError("placement check failed: " + "; ".join(problems[:3]) + more +
                          "; start each node's launcher with its own --node-rank (0 .. nnodes-1) "
                          "and the static rendezvous")
