"""FLOPs of a transformer layer (general form) and the time the GPU takes for them.

FLOP counts follow Narayanan et al. 2021 ("Efficient Large-Scale Language Model Training on GPU
Clusters Using Megatron-LM", SC'21, eq. 3) and Korthikanti et al. 2022 (eq. 7), written for any
attention (GQA: kv_dim <= q_dim), any FFN size and SwiGLU (three MLP matrices). A multiply-add
counts 2 FLOPs; backward costs twice the forward. The time model prices the attention score
GEMMs at the full s^2 (what its fitted GEMM efficiency was calibrated with). FLOP counts for
utilisation come in three conventions (`model_flops_per_step`, `hardware_flops_per_step`):
causal model FLOPs (the s^2 term halved: MFU), non-causal model FLOPs (the classic formula: for
the GPT block, kv = q = h, ffn = 4h, GELU, one step is 72 * Bg * s * L * h^2 * (1 + s/(6h) +
V/(12 L h))) and hardware FLOPs (non-causal, with the recompute pass: HFU).
"""
from __future__ import annotations

import numpy as np

from plan3d.cost.context import CostContext
from plan3d.vocab import RECOMPUTE_CODES

GEMMS_PER_LAYER = 6  # fused QKV, scores, scores x V, output projection, MLP up (+gate), MLP down
LINEAR_GEMMS = 4  # the weight GEMMs: fused QKV, output projection, MLP up (+gate), MLP down
ATTENTION_GEMMS = GEMMS_PER_LAYER - LINEAR_GEMMS  # scores, scores x V


def layer_gemm_flops(ctx: CostContext, tokens):
    """Forward FLOPs of a layer's weight GEMMs for `tokens` = B*s: 2 * tokens * (params)."""
    return 2 * tokens * (ctx.attn_weight_params + ctx.mlp_mats * ctx.hidden * ctx.ffn)


def layer_attention_flops(ctx: CostContext, batch):
    """Forward FLOPs of Q K^T and scores x V for `batch` sequences: 4 * B * s^2 * q_dim (MLA:
    2 B s^2 heads (nope + rope) + 2 B s^2 heads v_head, `CostContext.score_dim`)."""
    return 4 * batch * ctx.seq**2 * ctx.score_dim


def attention_work_flops(ctx: CostContext, batch):
    """The score GEMMs' FLOPs the kernel runs (`layer_attention_flops` x `CostContext.attention_work`:
    about half under a causal mask with flash attention), what the time model prices."""
    return layer_attention_flops(ctx, batch) * ctx.attention_work


def moe_active_gemm_flops(ctx: CostContext, tokens):
    """Forward FLOPs of an MoE layer's weight GEMMs one token passes through, for `tokens`
    tokens: attention, top_k routed experts, the shared experts and the router (h x experts) --
    the active parameters (`plan3d.cost.params.active_layer_params`), not all experts."""
    mlp = ctx.mlp_mats * ctx.hidden * (ctx.top_k * ctx.expert_ffn + ctx.shared_ffn)
    return 2 * tokens * (ctx.attn_weight_params + mlp + ctx.hidden * ctx.experts)


def logits_flops(ctx: CostContext, tokens):
    """Forward FLOPs of the output layer: 2 * tokens * h * V."""
    return 2 * tokens * ctx.hidden * ctx.vocab


def model_flops_per_step(ctx: CostContext, causal: bool = True) -> float:
    """Model FLOPs of one step (forward + backward = 3x forward, no recompute): what MFU counts.

    `causal`: the attention score GEMMs (Q K^T, scores x V) at half their s^2 work, since a causal
    mask leaves half the score matrix to compute (PaLM, Chowdhery et al. 2022, appendix B;
    Megatron-Core's `num_floating_point_operations` since 2025-03-06). False: the full s^2 term,
    as Narayanan et al. 2021 (eq. 3), Korthikanti et al. 2022 (eq. 7) and Megatron-Core before
    2025-03 count it (`mfu_noncausal`: at 128K tokens the two differ by tens of per cent)."""
    tokens = ctx.global_batch * ctx.seq
    attention = layer_attention_flops(ctx, ctx.global_batch) * (0.5 if causal else 1.0)
    forward = ctx.layers * (layer_gemm_flops(ctx, tokens) + attention)
    if ctx.moe_layers:  # MoE layers count their active parameters (top_k experts), as MFU does
        forward += ctx.moe_layers * (moe_active_gemm_flops(ctx, tokens) - layer_gemm_flops(ctx, tokens))
    return 3.0 * (forward + logits_flops(ctx, tokens))


def recompute_flops_per_step(ctx: CostContext, recompute, partial_share=0.0):
    """FLOPs the recompute pass adds to a step (`recompute`: RECOMPUTE_CODES, scalar or array):
    full recompute repeats every layer's forward (not the output layer's), selective only the
    attention core (Korthikanti et al. 2022, section 5), moe the MoE layers' expert, shared-expert
    and router GEMMs, mla-up the MLA up-projections; the s^2 term in full, as hardware FLOPs
    are counted (Narayanan et al. 2021: 96 B s L h^2 (1 + s/6h + V/16Lh) with full recompute)."""
    tokens = ctx.global_batch * ctx.seq
    attention = ctx.layers * layer_attention_flops(ctx, ctx.global_batch)
    layers = ctx.layers * layer_gemm_flops(ctx, tokens) + attention
    if ctx.moe_layers:
        layers += ctx.moe_layers * (moe_active_gemm_flops(ctx, tokens) - layer_gemm_flops(ctx, tokens))
    # the moe module reruns an MoE layer's expert, shared-expert and router GEMMs, not its attention
    moe_block = ctx.moe_layers * (moe_active_gemm_flops(ctx, tokens) - 2 * tokens * ctx.attn_weight_params)
    mla_up = ctx.layers * 2 * tokens * ctx.mla_up_params  # mla-up reruns the up-projections
    recompute = np.asarray(recompute)
    if ctx.selective_per_op:  # the dense layers' dropped linears (core.per_op_redo_s); MoE layers their attention
        dense = ctx.layers - ctx.moe_layers
        attention = (dense * 2 * tokens * ctx.hidden * (ctx.q_dim + ctx.ffn)
                     + ctx.moe_layers * layer_attention_flops(ctx, ctx.global_batch))
    return np.where(recompute >= RECOMPUTE_CODES["full"], layers,
                    np.where(recompute == RECOMPUTE_CODES["selective"], attention,
                             np.where(recompute == RECOMPUTE_CODES["partial"], partial_share * layers,
                                      np.where(recompute == RECOMPUTE_CODES["moe"], moe_block,
                                               np.where(recompute == RECOMPUTE_CODES["mla-up"], mla_up, 0.0)))))


def hardware_flops_per_step(ctx: CostContext, recompute, partial_share=0.0):
    """Hardware FLOPs of one step: non-causal model FLOPs plus the recompute pass (what HFU counts,
    and what Narayanan et al. 2021 and BLOOM report as TFLOP/s per GPU)."""
    return model_flops_per_step(ctx, causal=False) + recompute_flops_per_step(ctx, recompute, partial_share)


def gemm_s(ctx: CostContext, flops, kernels):
    """Time of `kernels` GEMMs totalling `flops` on one GPU: each kernel runs at
    max_fraction * w / (w + half_work) of peak, so together (flops + kernels * half_work) /
    (max_fraction * peak) -- a saturating efficiency curve in the per-GPU matrix size."""
    return (flops + kernels * ctx.gemm_half_work_flops) / (ctx.gemm_max_fraction * ctx.peak_flops)


def fp8_linear_s(ctx: CostContext, flops, kernels):
    """Time of `kernels` linear-layer GEMMs totalling `flops` in FP8: the FLOPs at the fp8
    ceiling (fp8_max_fraction of the fp8 peak), the fixed cost per kernel as long as a bf16
    kernel's (tile fill, launch and wave quantisation do not shrink with the data type, so small
    per-GPU matrices gain little from FP8)."""
    fixed = kernels * ctx.gemm_half_work_flops / (ctx.gemm_max_fraction * ctx.peak_flops)
    return flops / (ctx.fp8_max_fraction * ctx.fp8_peak_flops) + fixed


def fp8_cast_elements(ctx: CostContext, tokens, tp):
    """Elements one GPU casts to FP8 for one layer's forward and backward of `tokens` tokens:
    each linear GEMM's input (forward: the QKV and FC1 inputs, hidden-wide and whole on every tp
    rank; the projection and FC2 inputs, split by tp) and each one's output gradient (backward:
    the projection and FC2 ones hidden-wide, the QKV and FC1 ones split by tp)."""
    whole = 4 * tokens * ctx.hidden
    split = tokens * (ctx.q_dim + ctx.ffn + ctx.q_dim + 2 * ctx.kv_dim + ctx.mlp_mats * ctx.ffn) / tp
    return whole + split


def layer_gemms_s(ctx: CostContext, mb, tp):
    """Forward time of one layer's six GEMMs for one micro-batch on one GPU. 16/32-bit: all at
    one peak. FP8: the four linear GEMMs in FP8 (`fp8_linear_s`), the attention pair in bf16,
    plus a third of the layer's cast traffic (`fp8_cast_elements`: forward and backward together;
    the backward counts twice the forward, so forward + backward pay it once)."""
    tokens = mb * ctx.seq
    if not ctx.fp8_peak_flops:
        return gemm_s(ctx, (layer_gemm_flops(ctx, tokens) + attention_work_flops(ctx, mb)) / tp,
                      GEMMS_PER_LAYER + ctx.attn_extra_gemms)
    cast = memory_bound_s(ctx, fp8_cast_elements(ctx, tokens, tp), ctx.fp8_cast_bytes)
    return (fp8_linear_s(ctx, layer_gemm_flops(ctx, tokens) / tp, LINEAR_GEMMS + ctx.attn_extra_gemms)
            + gemm_s(ctx, attention_work_flops(ctx, mb) / tp, ATTENTION_GEMMS) + cast / 3)


def linear_s(ctx: CostContext, flops, kernels):
    """Linear-layer GEMMs: in FP8 under fp8 training (`fp8_linear_s`), else at the one peak (`gemm_s`)."""
    return fp8_linear_s(ctx, flops, kernels) if ctx.fp8_peak_flops else gemm_s(ctx, flops, kernels)


def memory_bound_s(ctx: CostContext, elements, bytes_per_element):
    """Time of memory-bound kernels that move `bytes_per_element` per element over HBM."""
    return elements * bytes_per_element / ctx.hbm_bytes_per_s


def layer_forward_s(ctx: CostContext, mb, tp, sp_div):
    """Forward time of one layer for one micro-batch on one GPU (no communication):
    weight GEMMs and attention GEMMs split by tp (`layer_gemms_s`: the weight GEMMs in FP8 under
    fp8), the elementwise work on the hidden-size activations (replicated over tp unless
    sequence parallel) and on the tp-split ones, and the attention-score traffic of an unfused
    softmax (zero with flash attention)."""
    tokens = mb * ctx.seq
    split_elements = tokens * (ctx.q_dim + 2 * ctx.kv_dim + ctx.mlp_mats * ctx.ffn) / tp
    elements = tokens * ctx.hidden / sp_div + split_elements
    scores = mb * ctx.heads / tp * ctx.seq**2
    return (layer_gemms_s(ctx, mb, tp)
            + memory_bound_s(ctx, elements, ctx.elementwise_bytes)
            + memory_bound_s(ctx, scores, ctx.attention_score_bytes))


def pass_s(ctx: CostContext, gpu_s, host_s):
    """Time of a pass: overlapped host and device (`host_bound_s`), or their sum where one core
    does both (`host_overlap` false: a CPU process)."""
    return host_bound_s(gpu_s, host_s) if ctx.host_overlap else gpu_s + host_s


def host_bound_s(gpu_s, host_s):
    """Time of a pass whose kernels take `gpu_s` on the GPU and `host_s` to issue on the host.

    Issue and execution overlap: large kernels hide the host (-> gpu_s), tiny ones leave the GPU
    waiting (-> host_s); in between, launch jitter empties the queue part of the time. A smooth
    maximum, the 3-norm (gpu^3 + host^3)^(1/3), covers the three regimes (the exponent was chosen
    on the training rows of benchmarks/accuracy.py: 2, 3, 4 gave 6.3, 6.1, 6.3% single-node MAPE)."""
    return (gpu_s**3 + host_s**3) ** (1 / 3)


def attention_core_forward_s(ctx: CostContext, mb, tp):
    """Forward time of the attention core alone (what selective recompute repeats)."""
    scores = mb * ctx.heads / tp * ctx.seq**2
    return (gemm_s(ctx, attention_work_flops(ctx, mb) / tp, 2)
            + memory_bound_s(ctx, scores, ctx.attention_score_bytes))


def logits_forward_s(ctx: CostContext, mb, tp):
    """Forward time of the output layer and the loss on the last stage (vocab split by tp)."""
    tokens = mb * ctx.seq
    vocab_tp = np.ceil(ctx.vocab / tp)
    return (gemm_s(ctx, 2 * tokens * ctx.hidden * vocab_tp, 1)
            + memory_bound_s(ctx, tokens * vocab_tp, ctx.elementwise_bytes))


def optimizer_s(ctx: CostContext, params_on_rank, optim_shard):
    """Adam step: memory-bound, reads and writes the rank's optimizer shard, master weights and
    gradients (~ (2 * optimizer + gradient + weight) bytes per parameter it updates)."""
    per_param = 2 * ctx.optim_bytes + ctx.grad_bytes + ctx.weight_bytes
    return params_on_rank / optim_shard * per_param / ctx.hbm_bytes_per_s
