"""The whole estimate as array arithmetic, shared by `estimate()` and `estimate_batch()`.

Stages come stacked on axis 0: every pipeline rank (scalar estimate, weight 1 each) or the three
kinds first / middle / last with their multiplicities (batch, even layer split). Each formula is
written once, in memory.py, compute.py, comm.py and pipeline.py; this module only adds them up.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from plan3d.cost import comm, compute, memory
from plan3d.cost.arrays import RECOMPUTE_CODES, LayoutArrays
from plan3d.cost.context import CostContext
from plan3d.cost.pipeline import masked_argmax, masked_max, pipeline_s

FULL, SELECTIVE = RECOMPUTE_CODES["full"], RECOMPUTE_CODES["selective"]
MEMORY_KEYS = ("weights", "gradients", "optimizer", "activations", "buffers", "reserve")
TIME_KEYS = ("compute", "recompute", "bubble", "tp_comm", "pp_comm", "overhead", "dp_comm", "zero_comm",
             "optimizer")
PER_MICRO_BATCH = ("compute", "recompute", "tp_comm", "pp_comm", "overhead")


@dataclass(frozen=True)
class Links:
    """Bandwidth (bytes/s) and latency (s) arrays of the tp, pp and dp groups."""

    tp_bw: np.ndarray
    tp_lat: np.ndarray
    pp_bw: np.ndarray
    pp_lat: np.ndarray
    dp_bw: np.ndarray
    dp_lat: np.ndarray


def stage_micro_batch_s(ctx: CostContext, la: LayoutArrays, links: Links, pp_rank, layers) -> dict:
    """Per micro-batch times of one rank of pipeline rank `pp_rank` holding `layers` layers.

    Each layer pass (forward, recompute, backward = 2x forward) costs its GPU time (kernels plus
    its two blocking TP all-reduces) combined with the host time to issue it; what the host adds
    beyond the GPU time is reported as `overhead`."""
    first, last = pp_rank == 0, pp_rank == la.pp - 1
    layer_fwd = compute.layer_forward_s(ctx, la.mb, la.tp, la.sp_div)
    boundary_bytes = la.mb * ctx.seq * ctx.hidden * ctx.act_bytes
    tp_pair = 2 * comm.all_reduce_s(boundary_bytes, la.tp, links.tp_bw, links.tp_lat)  # per pass
    full = la.recompute >= FULL
    redo = np.where(full, layer_fwd,
                    np.where(la.recompute == SELECTIVE, compute.attention_core_forward_s(ctx, la.mb, la.tp), 0.0))
    host = ctx.layer_overhead_s
    passes = (compute.host_bound_s(layer_fwd + tp_pair, host)
              + compute.host_bound_s(2 * layer_fwd + tp_pair, 2 * host)
              + np.where(full, compute.host_bound_s(layer_fwd + tp_pair, host), redo))
    gpu_layer = 3 * layer_fwd + redo + np.where(full, 3, 2) * tp_pair
    logits_fwd = np.where(last, compute.logits_forward_s(ctx, la.mb, la.tp), 0.0)
    embed = np.where(first, compute.memory_bound_s(ctx, la.mb * ctx.seq * ctx.hidden, ctx.elementwise_bytes), 0.0)
    return {"compute": 3 * (layers * layer_fwd + logits_fwd + embed), "recompute": layers * redo,
            "tp_comm": layers * np.where(full, 3, 2) * tp_pair, "pp_comm": _p2p_s(ctx, la, links, boundary_bytes),
            "overhead": layers * (passes - gpu_layer) + ctx.micro_batch_overhead_s,
            "backward": 2 * (layers * layer_fwd + logits_fwd)}


def _p2p_s(ctx: CostContext, la: LayoutArrays, links: Links, boundary_bytes):
    """Pipeline sends per micro-batch: one forward and one backward per chunk (v per rank).
    Each tp rank sends 1/tp of the boundary and the receivers all-gather it over tp (Megatron's
    scatter-gather optimisation, Narayanan et al. 2021 section 4.1)."""
    send = comm.p2p_s(boundary_bytes / la.tp, links.pp_bw, links.pp_lat)
    gather = np.where(la.sp > 0, 0.0, comm.all_gather_s(boundary_bytes, la.tp, links.tp_bw, links.tp_lat))
    return np.where(la.pp > 1, 2 * la.vpp * (send + gather), 0.0)


def stage_step_s(ctx: CostContext, la: LayoutArrays, links: Links, pp_rank, params, backward_s, compute_s) -> dict:
    """Per step work of one rank outside the pipeline: data-parallel gradient reduction (hidden
    behind `dp_overlap_fraction` of one backward), ZeRO-3 traffic (hidden behind the same share
    of the compute), the tied-embedding all-reduce between first and last stage, the optimizer.

    ZeRO-3 / FSDP with gradient accumulation gathers the weights in the forward and again in the
    backward (and in the recompute) of every micro-batch, and reduce-scatters that micro-batch's
    gradients, since an unsharded gradient buffer would undo the sharding (Rajbhandari et al.
    2020, section 7: 1.5x the all-reduce volume per pass; DeepSpeed and FSDP both reduce per
    micro-batch)."""
    grads = params * ctx.grad_bytes
    zero12 = comm.all_gather_s(grads, la.dp, links.dp_bw, links.dp_lat) + \
        comm.all_gather_s(params * ctx.weight_bytes, la.dp, links.dp_bw, links.dp_lat)
    dp = np.where(la.zero >= 1, zero12, comm.all_reduce_s(grads, la.dp, links.dp_bw, links.dp_lat))
    dp = np.where(la.zero >= 3, 0.0, dp)  # ZeRO-3 reduces per micro-batch, below
    shared = (pp_rank == 0) | (pp_rank == la.pp - 1)
    tied = ctx.tied & (la.pp > 1) & shared
    embed_bytes = memory.padded_vocab(ctx, la.tp) / la.tp * ctx.hidden * ctx.grad_bytes
    dp = dp + np.where(tied, comm.all_reduce_s(embed_bytes, 2.0, links.pp_bw, links.pp_lat), 0.0)
    gathers = 2 + np.where(la.recompute >= FULL, 1, 0)
    per_micro_batch = gathers * comm.all_gather_s(params * ctx.weight_bytes, la.dp, links.dp_bw, links.dp_lat) \
        + comm.all_gather_s(grads, la.dp, links.dp_bw, links.dp_lat)  # reduce-scatter of this micro-batch's grads
    zero3 = np.where(la.zero >= 3, la.m * per_micro_batch, 0.0)
    overlap = ctx.dp_overlap_fraction
    return {"dp_comm": np.maximum(dp - overlap * backward_s, 0.0),
            "zero_comm": np.maximum(zero3 - overlap * compute_s, 0.0),
            "optimizer": compute.optimizer_s(ctx, params, np.where(la.zero >= 1, la.dp, 1.0))}


def evaluate(ctx: CostContext, la: LayoutArrays, links: Links, pp_rank, layers, weights) -> dict:
    """Everything for the stacked stages: memory per stage, times, step time and rates."""
    mem = memory.stage_memory(ctx, la, pp_rank, layers)
    per_mb = stage_micro_batch_s(ctx, la, links, pp_rank, layers)
    per_mb_total = sum(per_mb[k] for k in PER_MICRO_BATCH)
    pipe, bubble = pipeline_s(per_mb_total, weights, la.m, la.vpp)
    extra = stage_step_s(ctx, la, links, pp_rank, mem["params"], per_mb["backward"],
                         la.m * (per_mb["compute"] + per_mb["recompute"]))
    slow = masked_argmax(per_mb_total, weights)
    pick = lambda a: np.take_along_axis(np.broadcast_to(a, per_mb_total.shape), slow[None], 0)[0]  # noqa: E731
    time = {k: la.m * pick(per_mb[k]) for k in PER_MICRO_BATCH}
    time["bubble"] = bubble
    time.update({k: masked_max(np.broadcast_to(v, per_mb_total.shape), weights) for k, v in extra.items()})
    return _summary(ctx, la, mem, time, weights)


def _summary(ctx: CostContext, la: LayoutArrays, mem: dict, time: dict, weights) -> dict:
    step = sum(time[k] for k in TIME_KEYS)
    shape = np.broadcast_shapes(*(np.shape(v) for v in mem.values()))
    totals = np.broadcast_to(mem["total"], shape)
    world = la.tp * la.pp * la.dp
    model_flops = compute.model_flops_per_step(ctx)
    achieved = model_flops / (step * world)
    return {
        "step_time_s": step, "tokens_per_s": ctx.global_batch * ctx.seq / step,
        "model_tflops_per_gpu": achieved / 1e12, "mfu": achieved / ctx.peak_flops,
        "peak_memory_bytes": masked_max(totals, weights), "worst_stage": masked_argmax(totals, weights),
        "capacity_bytes": np.full_like(step, ctx.capacity_bytes),
        "bubble_fraction": time["bubble"] / step,
        "time_s": time, "stage_memory": {k: np.broadcast_to(mem[k], shape) for k in MEMORY_KEYS + ("total",)},
    }
