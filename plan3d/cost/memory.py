"""Memory of one rank: model states (weights, gradients, optimizer), activations, buffers.

Sources: Rajbhandari et al. 2020 (ZeRO, SC'20) for the sharded model states; Korthikanti et
al. 2022 ("Reducing Activation Recomputation in Large Transformer Models", Table 2) for the
activations, assuming fused (flash) attention: the a*s^2 score matrix is never stored, so
selective recompute saves nothing on memory (it still costs its FLOPs). Everything is written
with numpy arithmetic so that `estimate()` and `estimate_batch()` share it.
"""
from __future__ import annotations

import numpy as np

from plan3d.cost.arrays import LayoutArrays, layout_arrays
from plan3d.cost.context import CostContext, make_context
from plan3d.layout import Layout
from plan3d.specs.model import ModelSpec
from plan3d.specs.training import TrainingSpec
from plan3d.vocab import RECOMPUTE_CODES

LOGITS_BYTES = 4  # the loss reads fp32 logits


# ---- parameters ----------------------------------------------------------------------------
def layer_params_split(ctx: CostContext) -> int:
    """Per-layer parameters that tensor parallelism divides: every weight matrix and the
    column-parallel biases (QKV, MLP up/gate) -- Shoeybi et al. 2019 (Megatron-LM)."""
    h, q, kv, f, mats = ctx.hidden, ctx.q_dim, ctx.kv_dim, ctx.ffn, ctx.mlp_mats
    weights = h * (q + 2 * kv) + q * h + mats * h * f
    biases = (q + 2 * kv) * ctx.qkv_bias + (mats - 1) * f * ctx.bias
    return weights + biases


def layer_params_replicated(ctx: CostContext) -> int:
    """Per-layer parameters every tp rank holds: two norms, the row-parallel output biases."""
    return 2 * ctx.norm_params + (2 * ctx.hidden if ctx.bias else 0)


def padded_vocab(ctx: CostContext, tp):
    """Vocabulary padded up to a multiple of tp (no padding when tp divides it)."""
    return np.ceil(ctx.vocab / tp) * tp


def stage_params(ctx: CostContext, tp, pp, pp_rank, layers_on_rank):
    """Parameters one rank of pipeline rank `pp_rank` holds (all its virtual chunks)."""
    layers = layers_on_rank * (layer_params_split(ctx) / tp + layer_params_replicated(ctx))
    vocab_rows = padded_vocab(ctx, tp) / tp * ctx.hidden
    first = np.where(pp_rank == 0, vocab_rows + ctx.position_params, 0.0)
    head = np.where(ctx.tied & (pp == 1), 0.0, vocab_rows)
    last = np.where(pp_rank == pp - 1, ctx.norm_params + head, 0.0)
    return layers + first + last


def model_states(ctx: CostContext, params, dp, zero) -> dict:
    """Bytes of weights, gradients and optimizer states on one rank under ZeRO stage `zero`:
    1 shards the optimizer over dp, 2 also the gradients, 3 also the weights (ZeRO paper, Fig. 1)."""
    return {
        "weights": params * ctx.weight_bytes / np.where(zero >= 3, dp, 1.0),
        "gradients": params * ctx.grad_bytes / np.where(zero >= 2, dp, 1.0),
        "optimizer": params * ctx.optim_bytes / np.where(zero >= 1, dp, 1.0),
    }


def model_state_bytes(model: ModelSpec, training: TrainingSpec, layout: Layout, pp_rank: int) -> dict:
    """Exact bytes of weights, gradients and optimizer states ONE rank of stage `pp_rank` holds."""
    ctx = make_context(None, model, training)
    layers = _rank_layers(layout, model.layers, pp_rank)
    params = stage_params(ctx, float(layout.tp), float(layout.pp), float(pp_rank), float(layers))
    states = model_states(ctx, params, float(layout.dp * layout.cp), float(layout.zero))
    return {k: float(v) for k, v in states.items()}


def _rank_layers(layout: Layout, layers: int, pp_rank: int) -> int:
    """Layers on pipeline rank `pp_rank`: its chunks pp_rank, pp_rank + pp, ..."""
    return sum(layout.stage_layers(layers)[pp_rank::layout.pp])


# ---- activations ---------------------------------------------------------------------------
def layer_activation_bytes(ctx: CostContext, la: LayoutArrays):
    """Bytes one layer stores for one micro-batch without recompute (Korthikanti Table 2 with
    flash attention): 10*s*B*h replicated (norm inputs, dropout masks; divided by tp under
    sequence parallelism), plus Q, K, V, the attention output and the MLP activations per tp.
    Context parallelism stores the rank's seq / cp tokens only (`LayoutArrays.mb_share`)."""
    sb = ctx.seq * la.mb_share
    replicated = 10 * sb * ctx.hidden / la.sp_div
    attention = 2 * sb * (2 * ctx.q_dim + 2 * ctx.kv_dim) / la.tp
    mlp = 2 * sb * ctx.ffn * ctx.mlp_mats / la.tp  # GELU: in, out; SwiGLU: gate, up, product
    return (replicated + attention + mlp) * ctx.act_bytes / 2


def in_flight(la: LayoutArrays, pp_rank):
    """Micro-batches whose activations rank `pp_rank` holds at its peak, in units of its full
    stage: p - r under 1F1B (Narayanan et al. 2021); with v chunks Megatron warms up
    2(p - r - 1) + (v - 1)p + 1 chunks, i.e. p(1 + (p-1)/(pv)) on the first rank (Korthikanti)."""
    plain = la.pp - pp_rank
    interleaved = (2 * (la.pp - pp_rank - 1) + (la.vpp - 1) * la.pp + 1) / la.vpp
    return np.minimum(np.where(la.vpp > 1, interleaved, plain), la.m)


def stage_activation_bytes(ctx: CostContext, la: LayoutArrays, pp_rank, layers_on_rank):
    """Activations at the peak of rank `pp_rank`: in-flight micro-batches times its layers
    (full recompute keeps only each layer's input, 2*s*B*h, plus one layer's working set), and
    the fp32 logits of one micro-batch on the last stage (its seq / cp tokens with context parallelism)."""
    per_layer = layer_activation_bytes(ctx, la)
    checkpoint = 2 * ctx.seq * la.mb_share * ctx.hidden / la.sp_div * ctx.act_bytes / 2
    stored = np.where(la.recompute >= RECOMPUTE_CODES["full"], checkpoint, per_layer)
    working = np.where(la.recompute >= RECOMPUTE_CODES["full"], per_layer, 0.0)
    acts = in_flight(la, pp_rank) * layers_on_rank * stored + working
    logits = ctx.seq * la.mb_share * padded_vocab(ctx, la.tp) / la.tp * LOGITS_BYTES
    return acts + np.where(pp_rank == la.pp - 1, logits, 0.0)


def buffer_bytes(ctx: CostContext, la: LayoutArrays):
    """Communication buffers: pipeline send/receive (forward and backward), the sequence-parallel
    all-gather output, under ZeRO-3 two gathered layers (one in use, one prefetched), and with
    context parallelism the ring's K/V buffers (`cp_ring_buffer_bytes`)."""
    boundary = ctx.seq * la.mb_share * ctx.hidden * ctx.act_bytes
    p2p = np.where(la.pp > 1, 2 * boundary / la.sp_div, 0.0)
    sp_gather = np.where(la.sp > 0, boundary, 0.0)
    layer_full = (layer_params_split(ctx) / la.tp + layer_params_replicated(ctx)) * ctx.weight_bytes
    return (p2p + sp_gather + np.where(la.zero >= 3, 2 * layer_full, 0.0)
            + np.where(la.cp > 1, cp_ring_buffer_bytes(ctx, la), 0.0))


CP_RING_BUFFERS = 4  # K/V-chunk-sized buffers at the ring's peak (the backward), see cp_ring_buffer_bytes


def cp_ring_buffer_bytes(ctx: CostContext, la: LayoutArrays):
    """The ring's communication buffers of the layer being computed: its peak is the backward,
    which double-buffers (K/V, dK/dV) pairs -- two buffers of twice a K/V chunk, i.e. 4 chunks
    (Transformer Engine AttnFuncWithCPAndKVP2P.backward, `p2p_comm_buffers` of shape (2, *kv.shape));
    the forward holds two K/V chunks in flight (received, being sent). One K/V chunk is
    2 * (seq / cp) * mb * kv_heads * head_dim / tp elements."""
    chunk = 2 * ctx.seq * la.mb_share * ctx.kv_dim / la.tp * ctx.act_bytes
    return CP_RING_BUFFERS * chunk


def stage_memory(ctx: CostContext, la: LayoutArrays, pp_rank, layers_on_rank) -> dict:
    """Every memory category of one rank of pipeline rank `pp_rank`, and their total."""
    params = stage_params(ctx, la.tp, la.pp, pp_rank, layers_on_rank)
    out = model_states(ctx, params, la.grad_ranks, la.zero)
    out["activations"] = stage_activation_bytes(ctx, la, pp_rank, layers_on_rank)
    out["buffers"] = buffer_bytes(ctx, la) + 0.0 * pp_rank
    out["reserve"] = np.full_like(out["buffers"], ctx.reserve_bytes)
    out["total"] = sum(out[k] for k in ("weights", "gradients", "optimizer", "activations", "buffers", "reserve"))
    out["params"] = params
    return out


__all__ = ["layout_arrays", "model_state_bytes", "stage_memory", "stage_params"]
