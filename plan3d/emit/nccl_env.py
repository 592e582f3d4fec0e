"""NCCL environment for a job script, by the kind of network between the nodes, as data.

The kind is read from the name of the cluster spec's outermost network tier (the one data
parallelism crosses): `NETWORK_KINDS` lists (name pattern, kind) in the order they are tried.
Every value is written as `export NAME="${NAME:-default}"`, so a site's own setting (its HCA
list, its interface name) wins over the default without editing the script.

What each setting does (NCCL environment variables, docs.nvidia.com/deeplearning/nccl/user-guide/
docs/env.html):
- `NCCL_SOCKET_IFNAME`: the interfaces NCCL's bootstrap (and, without InfiniBand, its data)
  uses; `^lo,docker0` excludes loopback and the Docker bridge, the usual wrong picks on a node
  with several interfaces.
- `NCCL_IB_HCA`: the InfiniBand adapters; the prefix `mlx5` selects every Mellanox ConnectX
  port (the DGX and HGX NICs) and nothing else.
- `NCCL_IB_GID_INDEX=3`: RoCE v2 over IPv4 on Mellanox NICs (index 3 of the GID table); with the
  default, NCCL may pick a RoCE v1 GID and fail or run slowly across subnets.
- `NCCL_IB_DISABLE=1`: plain Ethernet, sockets only (NCCL would otherwise probe for verbs).
A single-node job crosses no network; it gets only the bootstrap's interface rule.
"""
from __future__ import annotations

import fnmatch

from plan3d.plan import Plan

NETWORK_KINDS: tuple[tuple[str, str], ...] = (  # (tier-name pattern, kind), first match wins
    ("*roce*", "roce"), ("ib*", "infiniband"), ("*infiniband*", "infiniband"),
    ("*ethernet*", "ethernet"), ("eth*", "ethernet"), ("*tcp*", "ethernet"),
)
SOCKET_IFNAME = ("NCCL_SOCKET_IFNAME", "^lo,docker0")
NCCL_BY_KIND: dict[str, tuple[tuple[str, str], ...]] = {
    "infiniband": (SOCKET_IFNAME, ("NCCL_IB_HCA", "mlx5")),
    "roce": (SOCKET_IFNAME, ("NCCL_IB_HCA", "mlx5"), ("NCCL_IB_GID_INDEX", "3")),
    "ethernet": (SOCKET_IFNAME, ("NCCL_IB_DISABLE", "1")),
    "unknown": (SOCKET_IFNAME,),
    "single-node": (SOCKET_IFNAME,),
}


def network_kind(plan: Plan, nnodes: int) -> tuple[str, str]:
    """(kind, the tier name it was read from) of the network between the plan's nodes."""
    tier = plan.cluster.network[-1].name
    if nnodes <= 1:
        return "single-node", tier
    lowered = tier.lower()
    kind = next((k for pattern, k in NETWORK_KINDS if fnmatch.fnmatchcase(lowered, pattern)), "unknown")
    return kind, tier


def nccl_lines(plan: Plan, nnodes: int) -> list[str]:
    """Shell lines: a comment naming the network, then one overridable export per setting."""
    kind, tier = network_kind(plan, nnodes)
    where = ("one node: no network between nodes" if kind == "single-node"
             else f"network tier {tier!r} read as {kind}")
    lines = [f"# NCCL ({where}); a value already in the environment wins"]
    lines += [f'export {name}="${{{name}:-{value}}}"' for name, value in NCCL_BY_KIND[kind]]
    return lines
