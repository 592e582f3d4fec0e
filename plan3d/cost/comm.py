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
from plan3d.vocab import COLLECTIVE_KINDS

GROUPS = ("tp", "pp", "dp")
# the data-parallel group once more, with one NIC share per GPU across nodes (no multi-rail rings):
# what an engine that issues one small collective per parameter gets (RunsAs.zero3_collectives);
# the context-parallel ring (`cp`) and the group gradients are reduced over (`dp_cp`: dp x cp,
# Megatron-Core's dp_cp_group). With cp = 1, dp_cp is the dp group and the cp ring carries nothing.
# Expert parallelism: the all-to-all group (`ep`: each rank exchanges with every other, no rings;
# across nodes a GPU sends what leaves the node over its own NIC share and what stays over the
# node's link, `all_to_all_bandwidth`) and the expert-data-parallel group its experts'
# gradients are reduced over (`edp`, dp*cp/ep ranks). With ep = 1, edp is dp_cp and ep carries nothing.
# With an expert tensor-parallel degree other than tp (MoE Parallel Folding) the experts' token
# all-gather / reduce-scatter runs on their own group (`etp`); otherwise etp is the tp group.
LINK_GROUPS = GROUPS + ("dp_nic", "cp", "dp_cp", "ep", "edp", "etp")


@dataclass(frozen=True)
class GroupLink:
    """What one group of a layout sees of the network: per collective kind (COLLECTIVE_KINDS),
    the effective ring bandwidth per GPU (bytes/s) and the latency per hop (s)."""

    tier: str  # the innermost tier holding each whole group
    costs: tuple[tuple[float, float], ...]  # (bytes_per_s, latency_s) in COLLECTIVE_KINDS order
    # the group's split over NVLink domains (the first tier's: nodes, or an NVL72 rack): how many
    # it spans, the all-gather bandwidth per GPU inside one, and that of the tier the group spans
    # (a GPU's share of it); inside one domain: 1, and the tier's own bandwidth twice (what a
    # hierarchical dispatch reads)
    domains: int = 1
    inner_bytes_per_s: float = 0.0
    outer_bytes_per_s: float = 0.0

    def cost(self, op: str) -> tuple[float, float]:
        return self.costs[COLLECTIVE_KINDS.index(op)]

    @property
    def bytes_per_s(self) -> float:
        return self.cost("all_reduce")[0]

    @property
    def latency_s(self) -> float:
        return self.cost("all_reduce")[1]


def group_link(layout: Layout, name: str, tiers: tuple[ResolvedTier, ...], gpus_per_node: int,
               single_rail: bool = False, all_to_all: bool = False) -> GroupLink:
    """The tier a group spans (rank map) and its effective bandwidth and latency per collective
    (`single_rail`: across domains each GPU gets its own share of the outer tier only;
    `all_to_all`: the group exchanges pairwise, `all_to_all_bandwidth`)."""
    rankmap = rankmap_for(layout, gpus_per_node)
    index = rankmap.tier_index(name, list(tiers))
    tier = tiers[index]
    if index == 0:
        own = tier.cost("all_gather")[0]
        return GroupLink(tier.name, tuple(tier.cost(op) for op in COLLECTIVE_KINDS), 1, own, own)
    inner = tiers[index - 1]
    group = rankmap.group_array(name)[0]
    members = len(group) / len(np.unique(group // inner.domain_gpus))  # of the group in each inner domain
    nodes = len(np.unique(group // tiers[0].domain_gpus))  # NVLink domains: what a hierarchical dispatch crosses
    per_domain = 1 if single_rail else members
    costs = []
    for op in COLLECTIVE_KINDS:
        (inner_bw, _), (outer_bw, latency) = inner.cost(op), tier.cost(op)
        bandwidth = (all_to_all_bandwidth(len(group), members, inner_bw, outer_bw) if all_to_all
                     else min(inner_bw, per_domain * outer_bw))
        costs.append((bandwidth, latency))
    return GroupLink(tier.name, tuple(costs), nodes, tiers[0].cost("all_gather")[0], tier.cost("all_gather")[0])


def all_to_all_bandwidth(n: int, members: float, inner_bw: float, outer_bw: float) -> float:
    """Effective per-GPU bandwidth of a pairwise all-to-all over `n` ranks, `members` of them in
    each inner domain (a node): of the (n - 1)/n of its data a rank sends, (members - 1)/n goes to
    its own domain over the inner link and (n - members)/n leaves over its own share of the outer
    tier, both at once (Thakur et al. 2005's pairwise exchange; NCCL's all-to-all is one send/recv
    per peer, each on the link to that peer). Priced as all_gather_s prices (n - 1)/n of the data,
    this is the bandwidth that gives the slower of the two parts:
    (n - 1) / max((members - 1) / inner_bw, (n - members) / outer_bw)."""
    return (n - 1) / max((members - 1) / inner_bw, (n - members) / outer_bw)


@lru_cache(maxsize=65536)
def layout_links(tp: int, pp: int, dp: int, order: str, tiers: tuple[ResolvedTier, ...],
                 gpus_per_node: int, cp: int = 1, ep: int = 1, etp: int | None = None) -> dict[str, GroupLink]:
    """GroupLink of every LINK_GROUPS group for one shape (cached: the search asks many times).

    With cp = 1 the dp_cp group is the dp group (same link) and the cp ring is never priced, so
    neither costs a rank-map look-up; likewise ep = 1 (edp is dp_cp, no all-to-all)."""
    layout = Layout(tp=tp, pp=pp, dp=dp, cp=cp, ep=ep, etp=etp, order=order)
    links = {name: group_link(layout, name, tiers, gpus_per_node) for name in GROUPS}
    reduce_group = "dp_cp" if cp > 1 else "dp"
    links["dp_nic"] = group_link(layout, reduce_group, tiers, gpus_per_node, single_rail=True)
    links["cp"] = group_link(layout, "cp", tiers, gpus_per_node) if cp > 1 else links["tp"]
    links["dp_cp"] = group_link(layout, "dp_cp", tiers, gpus_per_node) if cp > 1 else links["dp"]
    links["ep"] = group_link(layout, "ep", tiers, gpus_per_node, all_to_all=True) if ep > 1 else links["tp"]
    links["edp"] = group_link(layout, "edp", tiers, gpus_per_node) if ep > 1 or layout.etp else links["dp_cp"]
    links["etp"] = group_link(layout, "etp", tiers, gpus_per_node) if layout.etp else links["tp"]
    return links


# ---- ring volumes: (bytes on the wire per GPU, latency hops); the cost model prices them below and
# `plan3d calibrate` fits bandwidth and latency to them (`plan3d.calibrate.collective_terms`) --------
def all_reduce_terms(size_bytes, n):
    """Ring all-reduce of `size_bytes` over `n` ranks: reduce-scatter then all-gather."""
    return 2 * (n - 1) / n * size_bytes, 2 * (n - 1)


def all_gather_terms(size_bytes, n):
    """Ring all-gather whose gathered result is `size_bytes` (or reduce-scatter of that input)."""
    return (n - 1) / n * size_bytes, n - 1


def p2p_terms(size_bytes, n=2):
    """One point-to-point send of `size_bytes` (`n` is not read: a send has two ends)."""
    return size_bytes, 1


RING_TERMS = {"all_reduce": all_reduce_terms, "all_gather": all_gather_terms, "reduce_scatter": all_gather_terms,
              "p2p": p2p_terms}


def _seconds(terms, bytes_per_s, latency_s):
    volume, hops = terms
    return volume / bytes_per_s + hops * latency_s


def all_reduce_s(size_bytes, n, bytes_per_s, latency_s):
    """Ring all-reduce of `size_bytes` over `n` ranks (zero for n = 1)."""
    return _seconds(all_reduce_terms(size_bytes, n), bytes_per_s, latency_s)


def all_gather_s(size_bytes, n, bytes_per_s, latency_s):
    """Ring all-gather (or reduce-scatter) whose gathered result is `size_bytes`."""
    return _seconds(all_gather_terms(size_bytes, n), bytes_per_s, latency_s)


def p2p_s(size_bytes, bytes_per_s, latency_s):
    """One point-to-point send of `size_bytes`."""
    return _seconds(p2p_terms(size_bytes), bytes_per_s, latency_s)


def reduce_scatter_s(size_bytes, n, bytes_per_s, latency_s):
    """Ring reduce-scatter of a `size_bytes` input: the all-gather's volume and hops."""
    return _seconds(RING_TERMS["reduce_scatter"](size_bytes, n), bytes_per_s, latency_s)


COST_OF = {"all_reduce": all_reduce_s, "all_gather": all_gather_s, "reduce_scatter": reduce_scatter_s}
