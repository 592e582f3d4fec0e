"""Time of a mixture-of-experts layer: its GEMMs at the tokens each local expert gets, the router,
the token permutation, and the expert-parallel all-to-alls.

Expert parallelism as Megatron-Core runs it (Shazeer et al. 2017; Lepikhin et al. 2020, GShard;
Megatron-Core MoELayer with MoEAlltoAllTokenDispatcher): the ep ranks of an expert-parallel group
(carved out of dp x cp) each hold experts / ep experts of every MoE layer; a rank's router picks
top_k experts per token, the dispatch all-to-all sends each token copy to the rank holding its
expert, the local experts run as a grouped GEMM, and the combine all-to-all brings the outputs
back. Expert tensor parallelism is tp (each expert's FFN split like the dense MLP) unless the
layout sets its own etp (MoE Parallel Folding; `LayoutArrays.expert_tp`).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from plan3d.cost import comm
from plan3d.cost.arrays import LayoutArrays
from plan3d.cost.compute import (ATTENTION_GEMMS, attention_work_flops, gemm_s, linear_s,
                                 memory_bound_s)
from plan3d.cost.context import CostContext
from plan3d.cost.memory import routed_tokens

A2A_PER_LAYER_PASS = 2  # dispatch and combine, in the forward; their transposes in the backward


def moe_layer_forward_s(ctx: CostContext, la: LayoutArrays):
    """Forward time of one MoE layer for one micro-batch on one rank (no communication).

    GEMMs: attention as in a dense layer; the shared experts as a dense MLP of their width; the
    router, h x experts per token (sequence-split under sequence parallelism); the local experts
    as experts/ep GEMM pairs (fused up+gate, down) over the rank's `routed_tokens` -- each pair
    priced by the saturating GEMM curve at its own size (top_k * tokens * ep / experts tokens per
    expert), so small experts run further below the ceiling than the dense MLP. Memory-bound
    work: the dense layer's elementwise terms at the MoE widths, the router's softmax/top-k over
    tokens x experts, and the permutation: every routed copy read and written once to gather it
    by expert before the dispatch and once more to restore token order after the combine."""
    tokens = la.mb_share * ctx.seq
    block = moe_block_work(ctx, la)
    attention_linear = 2 * tokens * ctx.attn_weight_params / la.tp
    linear = linear_s(ctx, attention_linear + block.gemm_flops, 2 + ctx.attn_extra_gemms + block.gemms)
    scores = gemm_s(ctx, attention_work_flops(ctx, la.mb_share) / la.tp, ATTENTION_GEMMS)
    elements = tokens * ctx.hidden / la.sp_div + tokens * (ctx.q_dim + 2 * ctx.kv_dim) / la.tp + block.elements
    score_traffic = memory_bound_s(ctx, la.mb_share * ctx.heads / la.tp * ctx.seq**2, ctx.attention_score_bytes)
    return (linear + block.router_s + scores + block.permute_s + score_traffic
            + memory_bound_s(ctx, elements, ctx.elementwise_bytes))


@dataclass(frozen=True)
class BlockWork:
    """The MoE block's work per micro-batch on one rank (MoELayer.forward without its all-to-alls)."""

    gemm_flops: object  # shared and routed expert GEMMs
    gemms: object  # how many GEMMs they are (the saturating curve prices each at its own size)
    router_s: object
    permute_s: object
    elements: object  # elementwise work, in elements


def moe_block_work(ctx: CostContext, la: LayoutArrays) -> BlockWork:
    """Shared experts as a dense MLP of their width, the local experts as experts/ep GEMM pairs
    over the rank's `routed_tokens`, the router (h x experts per token, sequence-split under SP),
    the permutation (every routed copy read and written twice) and the block's elementwise work."""
    tokens = la.mb_share * ctx.seq
    routed = routed_tokens(ctx, la)
    h, mats = ctx.hidden, ctx.mlp_mats
    flops = 2 * tokens * mats * h * ctx.shared_ffn / la.tp + 2 * routed * mats * h * ctx.expert_ffn / la.tp
    return BlockWork(gemm_flops=flops, gemms=(2 if ctx.shared_ffn else 0) + 2 * ctx.experts / la.ep,
                     router_s=gemm_s(ctx, 2 * tokens * h * ctx.experts / la.sp_div, 1),
                     permute_s=memory_bound_s(ctx, 2 * routed * h / la.sp_div, 2 * ctx.act_bytes),
                     elements=(tokens * mats * ctx.shared_ffn / la.tp + routed * mats * ctx.expert_ffn / la.tp
                               + tokens * ctx.experts / la.sp_div))


def moe_block_redo_s(ctx: CostContext, la: LayoutArrays):
    """Seconds per MoE layer and micro-batch that moe recompute adds (its all-to-alls are in
    `ep_comm_s`): the MoE block of `moe_layer_forward_s` again (`moe_block_work`) and the pre-MLP
    norm (read its input, write its output). The block's GEMMs are priced on their own here, not
    merged with the attention GEMMs as in the forward (a slightly lower efficiency for the smaller
    set)."""
    block = moe_block_work(ctx, la)
    norm = memory_bound_s(ctx, la.mb_share * ctx.seq * ctx.hidden / la.sp_div, 2 * ctx.act_bytes)
    return (linear_s(ctx, block.gemm_flops, block.gemms) + block.router_s + block.permute_s + norm
            + memory_bound_s(ctx, block.elements, ctx.elementwise_bytes))


def ep_a2a_bytes(ctx: CostContext, la: LayoutArrays):
    """Bytes one rank holds for one dispatch (or combine) all-to-all: its routed token copies of
    h elements, top_k * tokens * h at the busiest rank's load, sequence-split under sequence
    parallelism (Megatron-Core dispatches the sequence-parallel shard, then all-gathers the
    tokens over the expert tensor-parallel group); (ep - 1) / ep of it leaves the rank."""
    return routed_tokens(ctx, la) * ctx.hidden / la.sp_div * ctx.act_bytes


def all_to_all_s(size_bytes, n, bytes_per_s, latency_s):
    """Pairwise all-to-all of `size_bytes` per rank over `n` ranks: (n-1)/n of it leaves each rank,
    in n-1 exchanges (Thakur et al. 2005, pairwise exchange): the volume and hops of a ring
    all-gather, priced with the ep link's all-gather bandwidth and latency."""
    return comm.all_gather_s(size_bytes, n, bytes_per_s, latency_s)


def shared_experts_forward_s(ctx: CostContext, la: LayoutArrays):
    """Forward time of one MoE layer's shared experts for one micro-batch (their GEMM pair and
    elementwise work, split by tp); 0 without shared experts."""
    if not ctx.shared_ffn:
        return 0.0
    tokens = la.mb_share * ctx.seq
    gemms = linear_s(ctx, 2 * tokens * ctx.mlp_mats * ctx.hidden * ctx.shared_ffn / la.tp, 2)
    return gemms + memory_bound_s(ctx, tokens * ctx.mlp_mats * ctx.shared_ffn / la.tp, ctx.elementwise_bytes)


def remote_nodes_per_token(ctx: CostContext, nodes):
    """Expected number of other nodes one token's top_k copies reach when the ep group spans
    `nodes` nodes, each holding experts / nodes of the experts, and the router spreads tokens
    evenly (the balanced-routing assumption; the busiest rank's excess is `moe_load`): a node
    gets none of the k copies with probability C(E - e, k) / C(E, k), e = E / nodes.

    Group-limited routing whose groups are the ep group's nodes (DeepSeek-V3: 8 groups on 8 nodes,
    a token in its best 4, report sec. 2.1.2 "node-limited routing") picks M of the G nodes, and
    the k copies spread over the M * e experts there. With other groups the unlimited count is an
    upper bound, and used."""
    nodes = np.asarray(nodes, dtype=np.float64)
    per_node = ctx.experts / np.maximum(nodes, 1.0)
    limited = (ctx.router_groups > 1) & (nodes == ctx.router_groups)
    chosen = np.where(limited, ctx.router_group_top_k / np.maximum(nodes, 1.0), 1.0)  # P(a node is a candidate)
    pool = np.where(limited, ctx.router_group_top_k * per_node, float(ctx.experts))
    none = np.ones_like(nodes)
    for i in range(ctx.top_k):  # C(pool - e, k) / C(pool, k), as a product
        none = none * np.clip((pool - per_node - i) / np.maximum(pool - i, 1.0), 0.0, 1.0)
    return np.where(nodes > 1, (nodes - 1) * chosen * (1.0 - none), 0.0)


def hierarchical_dispatch_s(ctx: CostContext, la: LayoutArrays, ep_split, latency_s):
    """Seconds of one dispatch (or combine) as DeepEP's internode kernels run it (DeepSeek-V3
    report sec. 3.2.2; deepseek-ai/DeepEP README): each token crosses the network once per other
    node holding one of its experts (`remote_nodes_per_token`), over the GPU's own share of the
    outer tier, and every copy bound for another GPU moves once over NVLink (within the sending
    node, or forwarded inside the receiving one), both at once: the slower of the two, plus one
    outer latency per other node."""
    nodes, inner_bw, outer_bw = ep_split
    token_bytes = ep_a2a_bytes(ctx, la) / ctx.top_k  # each token once, not its top_k copies
    network = token_bytes * remote_nodes_per_token(ctx, nodes) / np.maximum(outer_bw, 1.0)
    nvlink = token_bytes * ctx.top_k * (la.ep - 1) / np.maximum(la.ep, 1) / np.maximum(inner_bw, 1.0)
    return np.maximum(network, nvlink) + (nodes - 1) * latency_s


def ep_comm_s(ctx: CostContext, la: LayoutArrays, ep_link, full_recompute, ep_split):
    """Exposed seconds of one MoE layer's all-to-alls per micro-batch: dispatch and combine in the
    forward, the same two in the backward, and again in a recompute's forward (`full_recompute`:
    full recompute, or moe recompute of the MoE layer). Each is a pairwise all-to-all of the
    routed copies, or, with a hierarchical dispatcher (deepep, hybridep) and an ep group across nodes (`ep_split`: its
    nodes and bandwidths, `Links.ep_split`), `hierarchical_dispatch_s`.

    What hides them: `ep_overlap_fraction` of each (0 by default: Megatron-Core 0.19 overlaps
    them with other micro-batches only with --overlap-moe-expert-parallel-comm, torchtitan 0.3
    not at all), and, where the engine runs the shared experts on a side stream while the
    all-to-alls are in flight (`shared_expert_overlap`, Megatron-Core --moe-shared-expert-overlap),
    the shared experts' time: their forward in a forward pass, twice it in the backward."""
    one = all_to_all_s(ep_a2a_bytes(ctx, la), la.ep, *ep_link)
    if ctx.ep_hierarchical:
        one = np.where(ep_split[0] > 1, hierarchical_dispatch_s(ctx, la, ep_split, ep_link[1]), one)
    one = one * (1 - ctx.ep_overlap_fraction)
    shared = shared_experts_forward_s(ctx, la) if ctx.shared_expert_overlap else 0.0
    forward = np.maximum(A2A_PER_LAYER_PASS * one - shared, 0.0)
    backward = np.maximum(A2A_PER_LAYER_PASS * one - 2 * shared, 0.0)
    exposed = np.where(full_recompute, 2 * forward, forward) + backward
    return np.where(la.ep > 1, exposed, 0.0)
