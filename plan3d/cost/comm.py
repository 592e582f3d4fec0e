"""Communication: which tier each group spans (from the rank map), and alpha-beta collectives.

Collective costs after Thakur, Rabenseifner and Gropp 2005 ("Optimization of Collective
Communication Operations in MPICH") and Patarasuk & Yuan 2009 (bandwidth-optimal ring
all-reduce): with n ranks, S bytes, per-GPU one-way bandwidth bw and latency alpha,
ring all-reduce = 2 (n-1)/n * S / bw + 2 (n-1) alpha; all-gather / reduce-scatter half of it;
point-to-point S / bw + alpha.

A group that spans domains of its tier (e.g. nodes) with k members per inner domain runs as
NCCL does: k rings in parallel, one per member's NIC share, so the crossing costs
2 (n-1)/n * S / min(bw_inner, k * bw_outer) -- the slower of the inner link and the k NIC
shares -- with the outer tier's latency per hop.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from plan3d.layout import Layout
from plan3d.rankmap import rankmap_for
from plan3d.specs.cluster import ResolvedTier

GROUPS = ("tp", "pp", "dp")


@dataclass(frozen=True)
class GroupLink:
    """What one group of a layout sees of the network."""

    tier: str  # the innermost tier holding each whole group
    bytes_per_s: float  # effective ring bandwidth per GPU
    latency_s: float


def group_link(layout: Layout, name: str, tiers: tuple[ResolvedTier, ...], gpus_per_node: int) -> GroupLink:
    """The tier a group spans (rank map) and its effective bandwidth and latency."""
    rankmap = rankmap_for(layout, gpus_per_node)
    index = rankmap.tier_index(name, list(tiers))
    tier = tiers[index]
    if index == 0:
        return GroupLink(tier.name, tier.effective_bytes_per_s, tier.latency_s)
    inner = tiers[index - 1]
    group = rankmap.group_array(name)[0]
    per_domain = len(group) / len(np.unique(group // inner.domain_gpus))
    bandwidth = min(inner.effective_bytes_per_s, per_domain * tier.effective_bytes_per_s)
    return GroupLink(tier.name, bandwidth, tier.latency_s)


@lru_cache(maxsize=65536)
def layout_links(tp: int, pp: int, dp: int, order: str, tiers: tuple[ResolvedTier, ...],
                 gpus_per_node: int, cp: int = 1) -> dict[str, GroupLink]:
    """GroupLink of tp, pp and dp for one shape (cached: the search asks many times)."""
    layout = Layout(tp=tp, pp=pp, dp=dp, cp=cp, order=order)
    return {name: group_link(layout, name, tiers, gpus_per_node) for name in GROUPS}


def all_reduce_s(size_bytes, n, bytes_per_s, latency_s):
    """Ring all-reduce of `size_bytes` over `n` ranks (zero for n = 1)."""
    return 2 * (n - 1) / n * size_bytes / bytes_per_s + 2 * (n - 1) * latency_s


def all_gather_s(size_bytes, n, bytes_per_s, latency_s):
    """Ring all-gather (or reduce-scatter) whose gathered result is `size_bytes`."""
    return (n - 1) / n * size_bytes / bytes_per_s + (n - 1) * latency_s


def p2p_s(size_bytes, bytes_per_s, latency_s):
    """One point-to-point send of `size_bytes`."""
    return size_bytes / bytes_per_s + latency_s
