"""The whole estimate as array arithmetic, shared by `estimate()` and `estimate_batch()`.

Stages come stacked on axis 0: every pipeline rank (scalar estimate, weight 1 each) or the three
kinds first / middle / last with their multiplicities (batch, even layer split). Each formula is
written once, in memory.py, compute.py, comm.py and pipeline.py; this module only adds them up.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from plan3d.cost import comm, compute, memory, moe
from plan3d.cost.arrays import LayoutArrays
from plan3d.cost.context import CostContext
from plan3d.cost.pipeline import masked_argmax, masked_max, pipeline_s
from plan3d.cost.comm import LINK_GROUPS
from plan3d.specs import schedule as schedules
from plan3d.vocab import COLLECTIVE_KINDS, MEMORY_TERMS, PER_MICRO_BATCH_TERMS, RECOMPUTE_CODES, TIME_TERMS

FULL, SELECTIVE, MOE_ACT = RECOMPUTE_CODES["full"], RECOMPUTE_CODES["selective"], RECOMPUTE_CODES["moe-act"]
MOE_BLOCK, MLA_UP = RECOMPUTE_CODES["moe"], RECOMPUTE_CODES["mla-up"]
PARTIAL, NONE = RECOMPUTE_CODES["partial"], RECOMPUTE_CODES["none"]


@dataclass(frozen=True)
class Links:
    """Bandwidth (bytes/s) and latency (s) arrays of the tp, pp and dp groups, per collective
    kind: `costs[(group, op)] = (bandwidth, latency)`."""

    costs: dict
    ep_split: tuple = (1.0, 0.0, 0.0)  # the ep group's nodes, bandwidth inside and out of one (GroupLink)

    def of(self, group: str, op: str = "all_reduce") -> tuple[np.ndarray, np.ndarray]:
        return self.costs[(group, op)]

    @classmethod
    def from_rows(cls, rows: np.ndarray) -> "Links":
        """From a (n, 2 * groups * ops + 3) table laid out by `link_row`."""
        costs, k = {}, 0
        for group in LINK_GROUPS:
            for op in COLLECTIVE_KINDS:
                costs[(group, op)] = (rows[:, k], rows[:, k + 1])
                k += 2
        return cls(costs, (rows[:, k], rows[:, k + 1], rows[:, k + 2]))


def link_row(links: dict) -> list[float]:
    """One row of `Links.from_rows` from the GroupLink of each group, then the ep group's split."""
    ep = links["ep"]
    return ([x for group in LINK_GROUPS for op in COLLECTIVE_KINDS for x in links[group].cost(op)]
            + [ep.domains, ep.inner_bytes_per_s, ep.outer_bytes_per_s])


def stage_micro_batch_s(ctx: CostContext, la: LayoutArrays, links: Links, pp_rank, layers, moe_layers=0.0) -> dict:
    """Per micro-batch times of one rank of pipeline rank `pp_rank` holding `layers` layers, of
    which `moe_layers` are mixture-of-experts layers.

    Each layer pass (forward, recompute, backward = 2x forward) costs its GPU time (kernels plus
    its two blocking TP all-reduces) combined with the host time to issue it; what the host adds
    beyond the GPU time is reported as `overhead`. An MoE layer's forward is `moe_layer_forward_s`
    and its expert-parallel all-to-alls are reported as `ep_comm` (`plan3d.cost.moe.ep_comm_s`).

    With context parallelism every formula reads the rank's share of each sequence
    (`LayoutArrays.mb_share` = mb / cp: Megatron-Core's 2 x cp load-balanced chunks give every
    rank the same GEMM and causal-attention work), and the exposed exchange of K/V
    (`cp_exposed_s`: p2p ring, all-gather or all-to-all, as the engine runs it) is added to
    `tp_comm`: the model-parallel traffic inside a layer."""
    first, last = pp_rank == 0, pp_rank == la.last_rank
    share = la.mb_share
    layer_fwd = compute.layer_forward_s(ctx, share, la.tp, la.sp_div)
    boundary_bytes = share * ctx.seq * ctx.hidden * ctx.act_bytes
    tp_pair = 2 * _tp_exchange_s(la, links, boundary_bytes) * (1 - tp_overlap(ctx, la))  # exposed, per pass
    full = la.recompute >= FULL
    attention_fwd = compute.attention_core_forward_s(ctx, share, la.tp)
    mla_up = mla_up_redo_s(ctx, la)
    selective_dense = per_op_redo_s(ctx, la) if ctx.selective_per_op else attention_fwd
    flash = flash_backward_extra_s(ctx, la)
    dense = _layer_passes(ctx, la, layer_fwd, tp_pair, selective_dense, mla_up_s=mla_up, bwd_extra_s=flash)
    if ctx.moe_layers:
        moe_fwd = moe.moe_layer_forward_s(ctx, la)
        routed = _layer_passes(ctx, la, moe_fwd, tp_pair, attention_fwd, moe_act_redo_s(ctx, la),
                               moe.moe_block_redo_s(ctx, la), mla_up, flash)
        per_rank = lambda key: (layers - moe_layers) * dense[key] + moe_layers * routed[key]  # noqa: E731
        off_dense, off_moe = offload_exposed_s(ctx, la, layer_fwd, moe_fwd)
        redo_moe_comm = full | (la.recompute == MOE_BLOCK)  # the recompute's forward repeats the all-to-alls
        ep_comm = moe_layers * moe.ep_comm_s(ctx, la, links.of("ep", "all_gather"), redo_moe_comm, links.ep_split)
        expert_tp = moe_layers * _expert_tp_gather_s(ctx, la, links, redo_moe_comm)
    else:
        per_rank = lambda key: layers * dense[key]  # noqa: E731
        ep_comm = expert_tp = np.zeros_like(layer_fwd)
        off_dense = off_moe = offload_exposed_s(ctx, la, layer_fwd, layer_fwd)[0]
    logits_fwd = np.where(last, compute.logits_forward_s(ctx, share, la.tp), 0.0)
    embed = np.where(first, compute.memory_bound_s(ctx, share * ctx.seq * ctx.hidden, ctx.elementwise_bytes), 0.0)
    ring_fwd, ring_bwd = cp_exposed_s(ctx, la, links, attention_fwd)
    ring = np.where(full, 2 * ring_fwd, ring_fwd) + ring_bwd
    return {"compute": 3 * (per_rank("fwd") + logits_fwd + embed) + per_rank("bwd_extra"), "recompute": per_rank("redo"),
            "tp_comm": (layers * np.where(full, 3, 2) * tp_pair + _vocab_parallel_s(ctx, la, links, first, last)
                        + np.where(la.cp > 1, layers * ring, 0.0) + expert_tp),
            "pp_comm": _p2p_s(ctx, la, links, boundary_bytes),
            "ep_comm": ep_comm,
            # every layer's copies but one: the layer whose backward comes next stays on the GPU
            "offload": np.maximum((layers - moe_layers) * off_dense + moe_layers * off_moe
                                  - np.where(moe_layers > 0, off_moe, off_dense), 0.0),
            "overhead": per_rank("host") + ctx.micro_batch_overhead_s,
            "backward": 2 * (per_rank("fwd") + logits_fwd) + per_rank("bwd_extra"),
            "bwd_extra": per_rank("bwd_extra")}  # in compute and backward: input-gradient work, not W


def offload_exposed_s(ctx: CostContext, la: LayoutArrays, layer_fwd, moe_fwd):
    """Exposed seconds per micro-batch of one (dense, MoE) layer's activation offload
    (`memory.offloaded_bytes`): the copy to host memory runs on its own stream beside the layer's
    forward and the copy back beside its backward (twice the forward), each at the GPU's host
    link (`GPUSpec.host_link_gbytes_per_s`); what outlasts the computation shows. The HBM traffic
    the copies add to the kernels they hide behind is not modelled. A fully recomputed layer
    moves nothing."""
    off_dense, off_moe = memory.offloaded_bytes(ctx, la)
    if not (ctx.offload_attention or ctx.offload_experts) or not ctx.host_bytes_per_s:
        return 0.0 * layer_fwd, 0.0 * moe_fwd
    keep = np.where(la.recompute >= FULL, 0.0, 1.0)
    def exposed(moved, fwd):
        copy = moved / ctx.host_bytes_per_s
        return keep * (np.maximum(copy - fwd, 0.0) + np.maximum(copy - 2 * fwd, 0.0))
    return exposed(off_dense, layer_fwd), exposed(off_moe, moe_fwd)


def _expert_tp_gather_s(ctx: CostContext, la: LayoutArrays, links: Links, full):
    """Seconds per micro-batch of one MoE layer's expert-tensor-parallel token exchange, net of the
    dense MLP's sequence-parallel exchange that `tp_pair` charges every layer.

    Megatron-Core's MoEAlltoAllTokenDispatcher, after the dispatch all-to-all, all-gathers the
    token copies over the experts' tensor-parallel group (etp, tp by default) and reduce-scatters
    the experts' outputs before the combine (`gather_from_sequence_parallel_region` /
    `reduce_scatter_to_sequence_parallel_region` on the routed tokens): the gathered tensor holds
    the R * etp / tp token copies of the etp group, R h * bytes at etp = tp, nothing at etp = 1.
    An MoE layer without shared experts has no dense MLP, so the MLP half of `tp_pair` (s B h over
    tp, with its overlap) is taken back; shared experts are a tensor-parallel MLP (Megatron-Core
    SharedExpertMLP on the tp group) and keep it. Forward, backward and a full recompute's forward
    each pay it."""
    gathered = memory.routed_tokens(ctx, la) * la.expert_tp / la.tp * ctx.hidden * ctx.act_bytes
    expert = (_collective_s(links, "etp", "all_gather", gathered, la.expert_tp)
              + _collective_s(links, "etp", "reduce_scatter", gathered, la.expert_tp))
    dense_mlp = _tp_exchange_s(la, links, la.mb_share * ctx.seq * ctx.hidden * ctx.act_bytes) * (1 - tp_overlap(ctx, la))
    net = expert - (0.0 if ctx.shared_ffn else dense_mlp)
    return np.where((la.tp > 1) | (la.expert_tp > 1), np.where(full, 3, 2) * net, 0.0)


def tp_overlap(ctx: CostContext, la: LayoutArrays):
    """The share of TP collectives hidden (`tp_overlap_fraction`), none where the engine cannot run
    its TP overlap next to the layout's ZeRO stage on this GPU (RunsAs.tp_overlap_conflict:
    Megatron-FSDP before Blackwell)."""
    return np.where(np.isin(la.zero, ctx.tp_overlap_off_zero), 0.0, ctx.tp_overlap_fraction)


def moe_act_redo_s(ctx: CostContext, la: LayoutArrays):
    """Seconds per MoE layer and micro-batch to recompute what moe-act discards
    (`memory.moe_act_discarded_elements`), memory-bound: the activation reads its mlp_mats - 1
    inputs and writes its output, the norm reads its input and writes its output."""
    act, norm = memory.moe_act_discarded_elements(ctx, la)
    return compute.memory_bound_s(ctx, act, ctx.mlp_mats * ctx.act_bytes) + compute.memory_bound_s(ctx, norm, 2 * ctx.act_bytes)


def per_op_redo_s(ctx: CostContext, la: LayoutArrays):
    """Seconds per dense layer and micro-batch that a per-op selective policy (torchtitan's
    SelectiveAC, `memory.per_op_saved_bytes`) recomputes: the linears whose outputs it drops (the
    attention output projection and the MLP's second: 2 sB h (q + f) / tp FLOPs, two GEMMs) and the
    layer's element-wise work (norms, RoPE, the activation), as `layer_forward_s` prices it."""
    tokens = ctx.seq * la.mb_share
    gemms = compute.gemm_s(ctx, 2 * tokens * ctx.hidden * (ctx.q_dim + ctx.ffn) / la.tp, 2)
    elements = tokens * ctx.hidden / la.sp_div + tokens * (ctx.q_dim + 2 * ctx.kv_dim + ctx.mlp_mats * ctx.ffn) / la.tp
    return gemms + compute.memory_bound_s(ctx, elements, ctx.elementwise_bytes)


def mla_up_redo_s(ctx: CostContext, la: LayoutArrays):
    """Seconds per layer and micro-batch to rebuild what mla-up discards (`memory.mla_up_discarded_elements`):
    the two up-projection GEMMs (latent -> per-head Q; latent -> per-head K and V), 2 sB (q_up +
    kv_up) / tp FLOPs, on the GEMM curve; 0 without MLA."""
    tokens = ctx.seq * la.mb_share
    return np.where(ctx.mla_up_params > 0, compute.gemm_s(ctx, 2 * tokens * ctx.mla_up_params / la.tp, 2), 0.0)


def flash_backward_extra_s(ctx: CostContext, la: LayoutArrays):
    """Seconds per layer and micro-batch a flash-attention backward adds beyond twice the forward:
    it recomputes the scores S = QK^T from Q and K (it keeps only the softmax statistics) before
    dP, dV, dQ and dK, five score-sized GEMMs against the forward's two, 2.5x the forward's
    FLOPs (Dao 2023, FlashAttention-2, sec. 3.1.2 and its FLOP count for the backward pass); the
    extra half of the attention core's GEMMs. Unfused attention keeps the softmax output and pays
    twice the forward, as every other kernel."""
    if not ctx.flash_attention:
        return 0.0 * la.tp
    return 0.5 * compute.gemm_s(ctx, compute.attention_work_flops(ctx, la.mb_share) / la.tp, 2)


def _layer_passes(ctx: CostContext, la: LayoutArrays, layer_fwd, tp_pair, attention_fwd, moe_act_s=0.0,
                  moe_block_s=0.0, mla_up_s=0.0, bwd_extra_s=0.0) -> dict:
    """One layer's forward time (`fwd`), its recompute (`redo`: the whole forward under full
    recompute, `attention_fwd` under selective (the attention core, or a per-op policy's share), `moe_act_s` under moe-act, `moe_block_s` under
    moe, `mla_up_s` and `moe_act_s` under mla-up) and what the host adds to its passes (`host`)."""
    full = la.recompute >= FULL
    redo = np.where(full, layer_fwd, np.where(la.recompute == SELECTIVE, attention_fwd,
                                              np.where(la.recompute == MOE_ACT, moe_act_s,
                                                       np.where(la.recompute == MOE_BLOCK, moe_block_s,
                                                                np.where(la.recompute == MLA_UP, mla_up_s + moe_act_s,
                                                                         0.0)))))
    host = ctx.layer_overhead_s
    passes = (compute.pass_s(ctx, layer_fwd + tp_pair, host)
              + compute.pass_s(ctx, 2 * layer_fwd + bwd_extra_s + tp_pair, 2 * host)
              + np.where(full, compute.pass_s(ctx, layer_fwd + tp_pair, host), redo))
    gpu_layer = 3 * layer_fwd + bwd_extra_s + redo + np.where(full, 3, 2) * tp_pair
    return {"fwd": layer_fwd, "redo": redo, "host": passes - gpu_layer, "bwd_extra": bwd_extra_s + 0.0 * layer_fwd}


def cp_exposed_s(ctx: CostContext, la: LayoutArrays, links: Links, attention_fwd):
    """Exposed seconds of one layer's context-parallel K/V exchange, (forward, backward), per
    micro-batch, as the engine runs it (`CostContext.cp_comm`, EngineSpec RunsAs.cp_comm)."""
    exchange = {"p2p": cp_ring_exposed_s, "all_gather": cp_all_gather_exposed_s, "a2a": cp_a2a_exposed_s}
    return exchange[ctx.cp_comm](ctx, la, links, attention_fwd)


def cp_ring_exposed_s(ctx: CostContext, la: LayoutArrays, links: Links, attention_fwd):
    """p2p, Megatron-Core's default cp_comm_type (TransformerConfig.cp_comm_type; Transformer
    Engine's AttnFuncWithCPAndKVP2P): cp steps; in each, a rank computes attention of its
    queries against one K/V chunk while it sends that chunk to the next rank and receives the
    next one (cp - 1 transfers, asynchronous). A transfer hides behind its step's attention
    (the rank's attention time / cp); what is left shows: (cp - 1) * max(0, send - step). The
    backward circulates K/V and their gradients dK/dV (twice the bytes) against the backward
    attention (twice the forward's FLOPs); where the blocks were saved in the forward
    (`cp_kv_saved`: plan3d's runtime) only dK/dV travel. An engine whose shifts are synchronous
    (`cp_ring_overlap` false: plan3d's runtime) hides nothing."""
    chunk = memory.cp_kv_chunk_bytes(ctx, la)
    steps = np.maximum(la.cp - 1, 0.0)
    step_fwd = attention_fwd / la.cp if ctx.cp_ring_overlap else 0.0 * attention_fwd
    send = comm.p2p_s(chunk, *links.of("cp", "p2p"))
    send_bwd = comm.p2p_s((1 if ctx.cp_kv_saved else 2) * chunk, *links.of("cp", "p2p"))
    return steps * np.maximum(send - step_fwd, 0.0), steps * np.maximum(send_bwd - 2 * step_fwd, 0.0)


def cp_all_gather_exposed_s(ctx: CostContext, la: LayoutArrays, links: Links, attention_fwd):
    """all_gather (Megatron-Core cp_comm_type "all_gather", Transformer Engine
    AttnFuncWithCPAndKVAllGather; torch's flex_cp_allgather under torchtitan 0.3): the forward
    all-gathers the whole sequence's K/V over cp before attention, blocking ("cannot be
    overlapped", TransformerConfig); the backward reduce-scatters dK/dV, after gathering K/V
    again unless the gathered K/V were saved (`cp_kv_saved`: autograd of the gather)."""
    gathered = la.cp * memory.cp_kv_chunk_bytes(ctx, la)
    gather = _collective_s(links, "cp", "all_gather", gathered, la.cp)
    scatter = _collective_s(links, "cp", "reduce_scatter", gathered, la.cp)
    return gather, scatter + (0.0 if ctx.cp_kv_saved else gather)


def cp_a2a_exposed_s(ctx: CostContext, la: LayoutArrays, links: Links, attention_fwd):
    """a2a (Megatron-Core cp_comm_type "a2a", DeepSpeed-Ulysses, Jacobs et al. 2023, arXiv
    2309.14509): all-to-alls turn the rank's Q, K, V (its seq / cp tokens, all its heads) into the
    whole sequence for heads / cp, and the attention output back; the backward does the same to
    dO and dQ, dK, dV. Each moves (cp - 1) / cp of the rank's Q + K + V + O bytes, blocking."""
    qkvo = la.mb_share * ctx.seq * (2 * ctx.q_dim + 2 * ctx.kv_dim) / la.tp * ctx.act_bytes
    a2a = _collective_s(links, "cp", "all_gather", qkvo, la.cp)
    return a2a, a2a


def _collective_s(links: Links, group: str, op: str, size_bytes, n):
    """Ring `op` of `size_bytes` over `n` ranks of `group`, with that kind's bandwidth and latency."""
    return comm.COST_OF[op](size_bytes, n, *links.of(group, op))


def _tp_exchange_s(la: LayoutArrays, links: Links, size_bytes):
    """One TP boundary exchange: an all-reduce, or with sequence parallelism the all-gather /
    reduce-scatter pair that moves the same volume (Korthikanti et al. 2022, section 4.2.2)."""
    pair = (_collective_s(links, "tp", "all_gather", size_bytes, la.tp)
            + _collective_s(links, "tp", "reduce_scatter", size_bytes, la.tp))
    return np.where(la.sp > 0, pair, _collective_s(links, "tp", "all_reduce", size_bytes, la.tp))


def _vocab_parallel_s(ctx: CostContext, la: LayoutArrays, links: Links, first, last):
    """TP traffic of the vocabulary-parallel ends, per micro-batch (Shoeybi et al. 2019, section 3;
    Megatron-LM VocabParallelEmbedding and _VocabParallelCrossEntropy): the embedding's partial
    lookups are summed over tp (all-reduce, or reduce-scatter + all-gather in the backward with
    sequence parallelism) and the output layer's input gradient likewise; the cross entropy over
    vocabulary shards all-reduces three per-token fp32 values (max logit, sum of exponentials,
    target logit). Latency-bound on GPUs, but milliseconds per call on an oversubscribed CPU."""
    boundary = _tp_exchange_s(la, links, la.mb_share * ctx.seq * ctx.hidden * ctx.act_bytes)
    loss = 3 * _collective_s(links, "tp", "all_reduce", la.mb_share * ctx.seq * 4, la.tp)
    return np.where(first, boundary, 0.0) + np.where(last, boundary + loss, 0.0)


def _step_sync_s(la: LayoutArrays, links: Links):
    """The two scalar all-reduces of every step over all ranks: the global gradient norm for
    clipping (Megatron-LM clip_grad_norm_fp32) and the logged loss. Latency only, as a tree:
    2 ceil(log2 n) hops (NCCL's tree for small messages; Thakur et al. 2005), at the slowest
    latency the layout's groups see. Measured on 8 gloo ranks: the two together take 4-15 ms a
    step against 17 ms predicted (a 14-hop ring would be 39 ms)."""
    world = la.tp * la.pp * la.grad_ranks
    hops = 2 * np.ceil(np.log2(np.maximum(world, 1.0)))
    latency = np.maximum(np.maximum(links.of("tp")[1], links.of("pp")[1]), links.of("dp_cp")[1])
    return 2 * hops * latency


def _p2p_s(ctx: CostContext, la: LayoutArrays, links: Links, boundary_bytes):
    """Pipeline sends per micro-batch: one forward and one backward per chunk (v per rank).
    Each tp rank sends 1/tp of the boundary and the receivers all-gather it over tp (Megatron's
    scatter-gather optimisation, Narayanan et al. 2021 section 4.1)."""
    send = comm.p2p_s(boundary_bytes / la.tp, *links.of("pp", "p2p"))
    gather = np.where(la.sp > 0, 0.0, _collective_s(links, "tp", "all_gather", boundary_bytes, la.tp))
    return np.where(la.pp > 1, 2 * la.vpp * (send + gather), 0.0)


def stage_step_s(ctx: CostContext, la: LayoutArrays, links: Links, pp_rank, params, backward_s, compute_s,
                 expert_params=0.0, layers=1.0, recompute_share=0.0) -> dict:
    """Per step work of one rank outside the pipeline: data-parallel gradient reduction (hidden
    behind `dp_overlap_fraction` of one backward), ZeRO-3 traffic (hidden behind the same share
    of the compute), the tied-embedding all-reduce between first and last stage, the optimizer.

    ZeRO-3 / FSDP with gradient accumulation gathers the weights in the forward and again in the
    backward (and in a full recompute, where the engine gathers again: `zero3_recompute_regathers`,
    DeepSpeed; FSDP2 and Megatron-FSDP reuse the recompute's gather for the backward) of every
    micro-batch, and reduce-scatters that micro-batch's
    gradients, since an unsharded gradient buffer would undo the sharding (Rajbhandari et al.
    2020, section 7: 1.5x the all-reduce volume per pass; DeepSpeed and FSDP both reduce per
    micro-batch).

    With context parallelism the group is dp x cp (`LayoutArrays.grad_ranks`): each cp rank
    holds gradients of its share of the tokens, reduced with the data-parallel replicas
    (Megatron-Core DistributedDataParallel.dp_cp_group). The routed experts' parameters
    (`expert_params`, MoE models) are reduced and sharded the same way over the expert-data-
    parallel group instead (`edp`, dp*cp/ep ranks), one after the other with the dense ones.

    ZeRO-3 moves a pass's weights as `zero3_collectives_per_layer` collectives per layer of the
    stage (FSDP2: one per block; DeepSpeed: one per submodule's weight), each paying the ring's
    n - 1 hops of latency: at 1024 ranks and 8 us a hop, 8 ms per gather."""
    grads = params * ctx.grad_bytes
    ranks = la.grad_ranks
    gather_weights = _collective_s(links, "dp_cp", "all_gather", params * ctx.weight_bytes, ranks)
    scatter_grads = _collective_s(links, "dp_cp", "reduce_scatter", grads, ranks)
    zero3_link = "dp_nic" if ctx.zero3_per_gpu_nic else "dp_cp"
    pieces = np.maximum(ctx.zero3_collectives_per_layer * layers, 1.0)
    zero3_gather = pieces * _collective_s(links, zero3_link, "all_gather", params * ctx.weight_bytes / pieces, ranks)
    zero3_scatter = pieces * _collective_s(links, zero3_link, "reduce_scatter", grads / pieces, ranks)
    all_reduce = _collective_s(links, "dp_cp", "all_reduce", grads, ranks)
    optimizer_s = compute.optimizer_s(ctx, params, np.where(la.zero >= 1, ranks, 1.0))
    if ctx.moe_layers:
        e_ranks, e_grads, e_weights = la.expert_grad_ranks, expert_params * ctx.grad_bytes, expert_params * ctx.weight_bytes
        gather_weights = gather_weights + _collective_s(links, "edp", "all_gather", e_weights, e_ranks)
        scatter_grads = scatter_grads + _collective_s(links, "edp", "reduce_scatter", e_grads, e_ranks)
        zero3_gather = zero3_gather + _collective_s(links, "edp", "all_gather", e_weights, e_ranks)
        zero3_scatter = zero3_scatter + _collective_s(links, "edp", "reduce_scatter", e_grads, e_ranks)
        all_reduce = all_reduce + _collective_s(links, "edp", "all_reduce", e_grads, e_ranks)
        optimizer_s = optimizer_s + compute.optimizer_s(ctx, expert_params, np.where(la.zero >= 1, e_ranks, 1.0))
    overlap = ctx.dp_overlap_fraction
    shared = (pp_rank == 0) | (pp_rank == la.last_rank)
    tied = ctx.tied & (la.pp > 1) & shared & ~la.v_shape  # V: the embedding and the output layer share rank 0
    embed_bytes = memory.padded_vocab(ctx, la.tp) / la.tp * ctx.hidden * ctx.grad_bytes
    tied_s = np.where(tied, _collective_s(links, "pp", "all_reduce", embed_bytes, 2.0), 0.0)
    # gradient reductions (and the tied-embedding one) hide behind the last micro-batch's
    # backward; an engine that overlaps the ZeRO-1/2 parameter all-gather with the next step's
    # first forward hides that behind the forward instead
    if ctx.param_gather_overlap:
        sharded = (np.maximum(scatter_grads + tied_s - overlap * backward_s, 0.0)
                   + np.maximum(gather_weights - overlap * backward_s / 2, 0.0))
    else:
        sharded = np.maximum(scatter_grads + gather_weights + tied_s - overlap * backward_s, 0.0)
    replicated = np.maximum(all_reduce + tied_s - overlap * backward_s, 0.0)
    zero3_tied = np.maximum(tied_s - overlap * backward_s, 0.0)  # ZeRO-3 grads: per micro-batch, below
    dp = np.where(la.zero >= 3, zero3_tied, np.where(la.zero >= 1, sharded, replicated))
    redo = np.where(la.recompute >= FULL, 1.0, np.where(la.recompute == PARTIAL, recompute_share, 0.0))
    gathers = 2 + (redo if ctx.zero3_recompute_regathers else 0.0)  # the recompute's gather, unless the backward reuses it
    per_micro_batch = gathers * zero3_gather + zero3_scatter  # and this micro-batch's grads reduce-scattered
    zero3 = np.where(la.zero >= 3, la.m * per_micro_batch, 0.0)
    zero3_overlap = overlap if ctx.zero3_overlap_fraction is None else ctx.zero3_overlap_fraction
    return {"dp_comm": dp + _step_sync_s(la, links),
            "zero_comm": np.maximum(zero3 - zero3_overlap * compute_s, 0.0),
            "optimizer": optimizer_s}


def core_share(ctx: CostContext, la: LayoutArrays):
    """The share of a CPU core each rank gets while all the ranks of its node are busy (<= 1; 1
    on GPUs). A layout smaller than a node fills one node's first slots."""
    if not ctx.cpu_cores_per_node:
        return 1.0
    ranks_on_node = np.minimum(la.tp * la.pp * la.grad_ranks, ctx.gpus_per_node)
    return np.minimum(1.0, ctx.cpu_cores_per_node / ranks_on_node)


def evaluate(ctx: CostContext, la: LayoutArrays, links: Links, pp_rank, layers, weights, moe_layers=0.0) -> dict:
    """Everything for the stacked stages: memory per stage, times, step time and rates
    (`moe_layers`: the MoE layers among each stage's `layers`).

    Extreme (schema-valid) inputs may overflow; the callers reject non-finite results with a
    message naming the input (`plan3d.cost.finite`), so numpy's own warnings are silenced here."""
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        return _evaluate(ctx, la, links, pp_rank, layers, weights, moe_layers)


def micro_batch_s(ctx: CostContext, la: LayoutArrays, links: Links, pp_rank, layers, moe_layers, recompute_share) -> dict:
    """`stage_micro_batch_s`; a partial-recompute rank (`memory.partial_recompute_layers`) is its
    share of the layers under full recompute and the rest without."""
    partial = la.recompute == PARTIAL
    if not np.any(partial):
        return stage_micro_batch_s(ctx, la, links, pp_rank, layers, moe_layers)
    plain = stage_micro_batch_s(ctx, replace(la, recompute=np.where(partial, NONE, la.recompute)), links, pp_rank,
                                layers, moe_layers)
    full = stage_micro_batch_s(ctx, replace(la, recompute=np.where(partial, FULL, la.recompute)), links, pp_rank,
                               layers, moe_layers)
    share = np.where(partial, recompute_share, 0.0)
    return {k: (1 - share) * plain[k] + share * full[k] for k in plain}


def f_b_overlapped(ctx: CostContext, la: LayoutArrays, per_mb: dict) -> dict:
    """Per micro-batch times under a schedule whose paired forward and backward chunks run
    concurrently (`RunsAs.f_b_overlap` and the schedule's `f_b_overlap`), or an engine that pairs
    them inside 1F1B (`RunsAs.ep_overlap` combined-1f1b, ep > 1: Megatron-Core's
    --overlap-moe-expert-parallel-comm): the expert-parallel all-to-alls hide behind the other
    micro-batch's computation, up to its length, while the computation runs on the SMs the
    communication leaves (`f_b_comm_sm_share`). DeepSeek-V3 report sec. 3.2.1-3.2.2 (DualPipe;
    20 of 132 SMs for the all-to-alls). The warm-up and cool-down chunks, which are not paired,
    are not singled out."""
    scheduled = schedules.column("f_b_overlap", la.schedule_codes) & (la.pp > 1) & ctx.f_b_overlap
    paired = scheduled | (ctx.ep_combined_1f1b & (la.ep > 1))
    if not np.any(paired):
        return per_mb
    slow = np.where(paired, 1.0 / (1.0 - ctx.f_b_comm_sm_share), 1.0)
    busy = (per_mb["compute"] + per_mb["recompute"]) * slow
    out = dict(per_mb, compute=per_mb["compute"] * slow, recompute=per_mb["recompute"] * slow)
    out["ep_comm"] = np.where(paired, np.maximum(per_mb["ep_comm"] - busy, 0.0), per_mb["ep_comm"])
    return out


def _evaluate(ctx: CostContext, la: LayoutArrays, links: Links, pp_rank, layers, weights, moe_layers) -> dict:
    mem = memory.stage_memory(ctx, la, pp_rank, layers, moe_layers)
    per_mb = f_b_overlapped(ctx, la, micro_batch_s(ctx, la, links, pp_rank, layers, moe_layers, mem["recompute_share"]))
    per_mb_total = sum(per_mb[k] for k in PER_MICRO_BATCH_TERMS)
    weight_grad = (per_mb["compute"] - per_mb["bwd_extra"]) / 3  # W of a zero-bubble schedule
    pipe, bubble = pipeline_s(per_mb_total, weights, la.m, la.vpp, core_share(ctx, la), weight_grad,
                              schedules.bubble_weights(la.schedule_codes))
    extra = stage_step_s(ctx, la, links, pp_rank, mem["params"], per_mb["backward"],
                         la.m * (per_mb["compute"] + per_mb["recompute"]), mem["expert_params"], layers,
                         mem["recompute_share"])
    slow = masked_argmax(per_mb_total, weights)
    pick = lambda a: np.take_along_axis(np.broadcast_to(a, per_mb_total.shape), slow[None], 0)[0]  # noqa: E731
    time = {k: la.m * pick(per_mb[k]) for k in PER_MICRO_BATCH_TERMS}
    time["bubble"] = bubble
    time.update({k: masked_max(np.broadcast_to(v, per_mb_total.shape), weights) for k, v in extra.items()})
    recomputed = np.sum(np.broadcast_to(mem["recompute_share"] * layers, weights.shape) * weights, axis=0)
    return _summary(ctx, la, mem, time, weights, recomputed / ctx.layers)


def _summary(ctx: CostContext, la: LayoutArrays, mem: dict, time: dict, weights, recompute_share=0.0) -> dict:
    step = sum(time[k] for k in TIME_TERMS)
    shape = np.broadcast_shapes(*(np.shape(v) for v in mem.values()))
    totals = np.broadcast_to(mem["total"], shape)
    world = la.tp * la.pp * la.grad_ranks
    per_gpu_s = step * world * ctx.peak_flops  # FLOPs one step at peak on every GPU
    model_flops = compute.model_flops_per_step(ctx)
    achieved = model_flops / (step * world)
    return {
        "step_time_s": step, "tokens_per_s": ctx.global_batch * ctx.seq / step,
        "model_tflops_per_gpu": achieved / 1e12, "mfu": achieved / ctx.peak_flops,
        "mfu_noncausal": compute.model_flops_per_step(ctx, causal=False) / per_gpu_s,
        "hfu": compute.hardware_flops_per_step(ctx, la.recompute, recompute_share) / per_gpu_s,
        "recompute_layers": np.max(np.broadcast_to(mem["recompute_layers"], totals.shape), axis=0),
        "peak_memory_bytes": masked_max(totals, weights), "worst_stage": masked_argmax(totals, weights),
        "capacity_bytes": np.full_like(step, ctx.capacity_bytes),
        "bubble_fraction": time["bubble"] / step,
        "time_s": time, "stage_memory": {k: np.broadcast_to(mem[k], shape) for k in MEMORY_TERMS + ("total", "host_offload")},
    }
