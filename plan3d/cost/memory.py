"""Memory of one rank: model states (weights, gradients, optimizer), activations, buffers.

Sources: Rajbhandari et al. 2020 (ZeRO, SC'20) for the sharded model states; Korthikanti et
al. 2022 ("Reducing Activation Recomputation in Large Transformer Models", Table 2) for the
activations, assuming fused (flash) attention: the a*s^2 score matrix is never stored, so
selective recompute saves nothing on memory (it still costs its FLOPs). Everything is written
with numpy arithmetic so that `estimate()` and `estimate_batch()` share it.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from plan3d.cost.arrays import LayoutArrays, layout_arrays
from plan3d.cost.context import CostContext, make_context
from plan3d.layout import Layout
from plan3d.specs import schedule as schedules
from plan3d.specs.engine import EngineSpec
from plan3d.specs.model import ModelSpec
from plan3d.specs.training import TrainingSpec
from plan3d.vocab import RECOMPUTE_CODES, modes_recomputing


# ---- parameters ----------------------------------------------------------------------------
def layer_params_split(ctx: CostContext) -> int:
    """Per-layer parameters that tensor parallelism divides: every weight matrix and the
    column-parallel biases (QKV, MLP up/gate) -- Shoeybi et al. 2019 (Megatron-LM)."""
    h, f, mats = ctx.hidden, ctx.ffn, ctx.mlp_mats
    return ctx.attn_split + mats * h * f + (mats - 1) * f * ctx.bias


def layer_params_replicated(ctx: CostContext) -> int:
    """Per-layer parameters every tp rank holds: two norms, the row-parallel output biases (and
    MLA's replicated down-projections, `CostContext.attn_replicated`)."""
    return 2 * ctx.norm_params + ctx.attn_replicated + (ctx.hidden if ctx.bias else 0)


def moe_layer_params_split(ctx: CostContext) -> int:
    """An MoE layer's dense part that tp divides: attention and the shared experts."""
    return ctx.attn_split + ctx.moe_shared_split


def moe_layer_params_replicated(ctx: CostContext) -> int:
    """An MoE layer's dense part every tp rank holds: norms, attention's replicated parameters,
    the router (h x experts, + bias), the shared gate, the shared experts' down bias."""
    return 2 * ctx.norm_params + ctx.attn_replicated + ctx.moe_replicated


def expert_rank_params(ctx: CostContext, tp, ep):
    """Parameters of the routed experts ONE rank holds per MoE layer: experts / ep local experts,
    each FFN split by `tp`, the experts' tensor-parallel degree (etp, by default the layout's tp:
    up/gate column-parallel with their biases, down row-parallel with its bias replicated;
    Megatron-Core --expert-tensor-parallel-size, default tp)."""
    return ctx.experts / ep * (ctx.expert_split / tp + ctx.expert_replicated)


def padded_vocab(ctx: CostContext, tp):
    """Vocabulary padded up to a multiple of tp (no padding when tp divides it)."""
    return np.ceil(ctx.vocab / tp) * tp


def stage_params(ctx: CostContext, tp, pp, pp_rank, layers_on_rank, moe_on_rank=0.0, last_rank=None):
    """Dense-part parameters one rank of pipeline rank `pp_rank` holds (all its virtual chunks):
    its dense layers, the dense part of its `moe_on_rank` MoE layers, and the ends (the output
    layer on `last_rank`: pp - 1, or 0 under a V-shaped schedule). Replicated over ep; ZeRO
    shards them over dp*cp."""
    layers = ((layers_on_rank - moe_on_rank) * (layer_params_split(ctx) / tp + layer_params_replicated(ctx))
              + moe_on_rank * (moe_layer_params_split(ctx) / tp + moe_layer_params_replicated(ctx)))
    vocab_rows = padded_vocab(ctx, tp) / tp * ctx.hidden
    first = np.where(pp_rank == 0, vocab_rows + ctx.position_params, 0.0)
    head = np.where(ctx.tied & (pp == 1), 0.0, vocab_rows)
    last = np.where(pp_rank == (pp - 1 if last_rank is None else last_rank), ctx.norm_params + head, 0.0)
    return layers + first + last


def model_states(ctx: CostContext, params, dp, zero, expert_params=0.0, edp=1.0, pp=1.0) -> dict:
    """Bytes of weights, gradients and optimizer states on one rank under ZeRO stage `zero`:
    1 shards the optimizer over dp, 2 also the gradients, 3 also the weights (ZeRO paper, Fig. 1).
    The routed experts' parameters (`expert_params`) shard the same way over the expert-data-
    parallel group `edp` = dp*cp/ep instead (Megatron-Core's distributed optimizer shards expert
    parameters over expert_data_parallel_group). Gradients as the engine keeps them: its buffer
    (`grad_bytes`) and the 16-bit copies it keeps beside an fp32 one (`grad_copy_bytes`). An engine
    whose FSDP keeps a stage's parameters gathered and its gradients unsharded across the
    micro-batches of a pipeline (`fsdp_unsharded_with_pp`, pp > 1 and ZeRO >= 2: torchtitan) holds
    the weights whole and an unsharded fp32 gradient beside the sharded one."""
    def part(per_param, stage):
        return sharded_bytes(per_param, stage, params, dp, zero, expert_params, edp)
    held = np.asarray(ctx.fsdp_unsharded_with_pp & (pp > 1) & (zero >= 2))
    unsharded_grads = np.where(held, (params + expert_params) * ctx.grad_bytes, 0.0)
    return {"weights": np.where(held, part(ctx.weight_bytes, 4), part(ctx.weight_bytes, 3)),
            "gradients": part(ctx.grad_bytes + ctx.grad_copy_bytes, 2) + unsharded_grads,
            "optimizer": part(ctx.optim_bytes, 1)}


def sharded_bytes(per_param, stage, params, dp, zero, expert_params=0.0, edp=1.0):
    """Bytes of `per_param` bytes per parameter that ZeRO stage `stage` and above shard: the dense
    part over dp (dp*cp), the routed experts over their expert-data-parallel group."""
    return (params * per_param / np.where(zero >= stage, dp, 1.0)
            + expert_params * per_param / np.where(zero >= stage, edp, 1.0))


def gradient_work_bytes(ctx: CostContext, la: LayoutArrays, params, expert_params=0.0):
    """Gradient memory outside the model states (`CostContext` fields, from the engine profile):
    the optimizer step's fp32 copy of 16-bit gradients, sharded as the optimizer states
    (`step_grad_cast_bytes`; `unsharded_step_cast_bytes` without ZeRO), and the flat bucket the engine's reduction copies gradients into
    (`reduce_bucket_elements` in the gradient dtype, at most the rank's gradients: DeepSpeed
    stage_1_and_2.py allocates `ipg_buffer` of reduce_bucket_size elements for a pipeline's
    reduction, and its engine's buffered all-reduce flattens buckets of 5e8 elements)."""
    per_param = np.where(la.zero == 0, ctx.unsharded_step_cast_bytes, ctx.step_grad_cast_bytes)
    cast = sharded_bytes(per_param, 1, params, la.grad_ranks, la.zero, expert_params, la.expert_grad_ranks)
    bucket = np.minimum(ctx.reduce_bucket_elements, params + expert_params) * ctx.grad_bytes
    return cast + bucket


def model_state_bytes(model: ModelSpec, training: TrainingSpec, layout: Layout, pp_rank: int,
                      engine: EngineSpec | None = None) -> dict:
    """Exact bytes of weights, gradients and optimizer states ONE rank of stage `pp_rank` holds
    (the shared accounting contract: dense part over dp*cp, routed experts over the expert-data-parallel
    ranks, dp*cp/ep, or tp*cp*dp/(ep*etp) with an expert tp of its own), gradients as `engine` keeps them."""
    ctx = make_context(None, model, training, engine)
    layers, moe = rank_layer_counts(model, layout, pp_rank)
    params = stage_params(ctx, float(layout.tp), float(layout.pp), float(pp_rank), float(layers), float(moe),
                          float(layout.rank_of_stage(layout.pp * layout.vpp - 1)))
    experts = moe * expert_rank_params(ctx, float(layout.expert_tp), float(layout.ep))
    dp_cp = float(layout.dp * layout.cp)
    states = model_states(ctx, params, dp_cp, float(layout.zero), experts, float(layout.expert_dp), float(layout.pp))
    return {k: float(v) for k, v in states.items()}


def chunk_moe_layers(model: ModelSpec, chunks: tuple[int, ...]) -> list[int]:
    """MoE layers in each virtual stage of a split (`chunks`: layers per stage, in order)."""
    out, start = [], 0
    for n in chunks:
        out.append(sum(model.is_moe_layer(i) for i in range(start, start + n)))
        start += n
    return out


def rank_layer_counts(model: ModelSpec, layout: Layout, pp_rank: int) -> tuple[int, int]:
    """(layers, MoE layers) on pipeline rank `pp_rank`: the chunks its schedule places there
    (pp_rank, pp_rank + pp, ...; or pp_rank and 2 pp - 1 - pp_rank, V-shaped)."""
    chunks = layout.stage_layers(model.layers)
    mine = [layout.rank_of_stage(s) == pp_rank for s in range(len(chunks))]
    return (sum(n for n, m in zip(chunks, mine) if m),
            sum(n for n, m in zip(chunk_moe_layers(model, chunks), mine) if m))


# ---- activations ---------------------------------------------------------------------------
def layer_activation_bytes(ctx: CostContext, la: LayoutArrays):
    """Bytes one layer stores for one micro-batch without recompute (Korthikanti Table 2, whose
    34*s*B*h count this reproduces for a GELU MLP of 4h with dropout): the `norm_mask_bytes`
    (divided by tp under sequence parallelism), Q, K, V, the attention output and the MLP
    activations per tp, and with unfused attention the scores (`attention_score_store_bytes`).
    Context parallelism stores the rank's seq / cp tokens only (`LayoutArrays.mb_share`), plus
    the other ranks' K/V where the engine saves the gathered K/V (`cp_saved_kv_bytes`)."""
    sb = ctx.seq * la.mb_share
    attention = 2 * sb * (2 * ctx.q_dim + 2 * ctx.kv_dim) / la.tp
    mlp = 2 * sb * ctx.ffn * ctx.mlp_mats / la.tp  # GELU: in, out; SwiGLU: gate, up, product
    return ((attention + mlp) * ctx.act_bytes / 2 + norm_mask_bytes(ctx, la) + attention_score_store_bytes(ctx, la)
            - fp8_saved_input_bytes(ctx, la) + cp_saved_kv_bytes(ctx, la))


def norm_mask_bytes(ctx: CostContext, la: LayoutArrays):
    """The h-wide tensors of a layer every tp rank keeps whole (divided by tp under sequence
    parallelism): the two norms' inputs and the QKV and MLP inputs (4 activations), and with
    dropout the 1-byte masks of the two hidden dropouts (Korthikanti et al. 2022, Sec. 4.1: the
    10*s*b*h of Table 2 is 4 + 2 + 2 bytes of tensors and 2 of masks). A model without dropout
    keeps no masks (torch's dropout returns its input for p = 0)."""
    sb = ctx.seq * la.mb_share
    masks = 2 if ctx.dropout else 0
    return (4 * ctx.act_bytes + masks) * sb * ctx.hidden / la.sp_div


def attention_score_store_bytes(ctx: CostContext, la: LayoutArrays):
    """What unfused attention (the engine's `runs_as.attention: unfused`) saves per layer and
    micro-batch: the softmax output of its a*s*s*B/tp scores, and with dropout the 1-byte mask
    and the dropout output (Korthikanti et al. 2022, Table 2's 5*a*s/h term: 2 + 1 + 2 bytes per
    score). Flash attention saves none. Selective recompute drops it (`stage_activation_bytes`)."""
    if not ctx.scores_stored:
        return 0.0 * la.tp
    per_score = ctx.act_bytes + ((1 + ctx.act_bytes) if ctx.dropout else 0)
    return per_score * ctx.heads / la.tp * ctx.seq * la.mb_share * ctx.seq


def fp8_saved_input_bytes(ctx: CostContext, la: LayoutArrays):
    """Bytes FP8 training saves per layer and micro-batch: Transformer Engine keeps the FP8 cast of
    each linear GEMM's input for the weight-gradient GEMM instead of the bf16 tensor (TE
    Linear/LayerNormLinear/LayerNormMLP save `inputmat` after the cast; torchao float8 likewise),
    one byte less per element of the QKV and FC1 inputs (the norm outputs, h wide, sequence-split
    under SP), the projection input (q_dim / tp) and the FC2 input (ffn / tp). The norm inputs,
    Q/K/V and the attention core stay bf16. Zero unless fp8."""
    if not ctx.fp8:
        return 0.0
    sb = ctx.seq * la.mb_share
    return sb * (2 * ctx.hidden / la.sp_div + ctx.q_dim / la.tp + ctx.ffn / la.tp)


FP8_WEIGHT_CACHE_BYTES = 2  # FP8 weight + its FP8 transpose, per linear weight element


def fp8_weight_cache_bytes(ctx: CostContext, la: LayoutArrays, layers_on_rank, moe_on_rank):
    """Transformer Engine's FP8 weight caches on one rank: with Megatron-Core's
    `is_first_microbatch` (TE modules cast each weight once per step and reuse the FP8 copy and
    its transpose for the later micro-batches), two bytes per linear weight element the rank
    holds (its dense layers' and MoE layers' tp-split weights, its local experts'); under ZeRO-3
    only the two gathered layers of `buffer_bytes` have one. Zero unless fp8 (Megatron-Core's
    --fp8-param-gather, which stores the weights in FP8 instead, is not modelled)."""
    if not ctx.fp8:
        return 0.0 * la.tp
    dense = layer_params_split(ctx) / la.tp
    moe = moe_layer_params_split(ctx) / la.tp + expert_rank_params(ctx, la.expert_tp, la.ep) if ctx.moe_layers else dense
    held = (layers_on_rank - moe_on_rank) * dense + moe_on_rank * moe
    gathered = 2 * np.maximum(dense, moe)
    return FP8_WEIGHT_CACHE_BYTES * np.where(la.zero >= 3, np.minimum(held, gathered), held)


def routed_tokens(ctx: CostContext, la: LayoutArrays):
    """Token copies the local experts of one rank compute per micro-batch: top_k * tokens on
    average (each of the ep ranks of an expert-parallel group routes top_k * tokens copies, and a
    rank's experts / ep local experts get 1/ep of them), times the load of the busiest rank
    (`CostContext.moe_load`: the capacity factor, or the imbalance prior). With expert tensor
    parallelism etp = tp every tp rank of an expert computes all its tokens (on its share of the
    FFN); with another etp a rank computes etp / tp of them (`LayoutArrays.expert_tp`)."""
    return ctx.top_k * ctx.seq * la.mb_share * ctx.moe_load


def moe_layer_activation_bytes(ctx: CostContext, la: LayoutArrays):
    """Bytes one MoE layer stores for one micro-batch without recompute: the dense layer's
    norm/attention terms, the shared experts as a dense MLP of their width, the routed experts'
    FFN activations for the `routed_tokens` they compute (split by tp), the permuted tokens (the
    experts' input, routed x h, whole on every tp rank) and their output before the combine,
    and the router's logits and probabilities (tokens x experts, sequence-split under sequence
    parallelism). The output is kept at the engine's `moe_combine_output_bytes` per element: none where the router
    probabilities scale the experts' activation (current Megatron-Core), fp32 under torchtitan."""
    sb = ctx.seq * la.mb_share
    attention = 2 * sb * (2 * ctx.q_dim + 2 * ctx.kv_dim) / la.tp
    return (attention * ctx.act_bytes / 2 + moe_block_bytes(ctx, la) + norm_mask_bytes(ctx, la)
            + attention_score_store_bytes(ctx, la) + cp_saved_kv_bytes(ctx, la) - fp8_moe_saved_input_bytes(ctx, la))


def moe_block_bytes(ctx: CostContext, la: LayoutArrays):
    """What the MoE block of a layer (MoELayer.forward) stores per micro-batch: the shared and
    routed experts' FFN tensors and the permuted tokens at the activation dtype, the experts'
    output before the combine at the engine's `moe_combine_output_bytes`, and the router's logits
    and probabilities (`moe_layer_activation_bytes`)."""
    sb = ctx.seq * la.mb_share
    routed = routed_tokens(ctx, la)
    ffn = 2 * sb * ctx.shared_ffn * ctx.mlp_mats / la.tp + 2 * routed * ctx.expert_ffn * ctx.mlp_mats / la.tp
    permuted = routed * la.expert_tp / la.tp * ctx.hidden  # elements, each way
    router = 2 * sb * ctx.experts / la.sp_div
    return ffn * ctx.act_bytes / 2 + (permuted + router) * ctx.act_bytes + permuted * ctx.moe_combine_output_bytes


def fp8_moe_saved_input_bytes(ctx: CostContext, la: LayoutArrays):
    """Bytes an MoE layer saves in FP8 instead of bf16 (one byte less per element), as Transformer
    Engine's Linear and GroupedLinear keep the FP8 cast of their input for the weight gradient:
    the attention's QKV input (the norm output, h wide, sequence-split under SP) and projection
    input (q_dim / tp), and the routed experts' FC1 input (the permuted tokens, routed x h x etp /
    tp) -- except under moe recompute, which drops the whole block (`moe_block_discarded_bytes`,
    at bf16). Left at bf16: the pre-MLP norm output (the router reads it in bf16), the experts'
    FC2 input (moe-act recompute discards it; its FP8 copy is not modelled either way), the shared
    experts. Zero unless fp8."""
    if not ctx.fp8:
        return 0.0
    sb = ctx.seq * la.mb_share
    attention = sb * (ctx.hidden / la.sp_div + ctx.q_dim / la.tp)
    fc1 = routed_tokens(ctx, la) * la.expert_tp / la.tp * ctx.hidden
    return attention + np.where(la.recompute == RECOMPUTE_CODES["moe"], 0.0, fc1)


def moe_act_discarded_elements(ctx: CostContext, la: LayoutArrays):
    """(activation, norm) elements per MoE layer and micro-batch that Megatron-Core's moe-act
    recompute (`--recompute-modules moe_act layernorm`) does not keep: the routed experts'
    activation output, the FC2 input (one of the `mlp_mats` FFN tensors of
    `moe_layer_activation_bytes`; SwiGLU's product, GELU's output), and the pre-MLP norm's output
    (one of the four h-wide tensors of `norm_mask_bytes`). Both are output-discarding checkpoints
    (TransformerConfig.recompute_modules: CheckpointWithoutOutput frees the output once its consumer
    has saved a reference and recomputes it in the backward). The attention's input norm is fused
    into Transformer Engine's LayerNormLinear and is not a separate module, so it stays."""
    sb = ctx.seq * la.mb_share
    return routed_tokens(ctx, la) * ctx.expert_ffn / la.tp, sb * ctx.hidden / la.sp_div


def recomputes_module(la: LayoutArrays, module: str):
    """Per layout: whether its recompute mode's Megatron-Core module list holds `module`."""
    return np.isin(la.recompute, [RECOMPUTE_CODES[m] for m in modes_recomputing(module)])


def input_norm_discarded_elements(ctx: CostContext, la: LayoutArrays):
    """Elements per layer and micro-batch the layernorm recompute module also drops where the
    attention's input norm is a module of its own: multi-head latent attention (Megatron-Core's MLA
    layer spec builds input_layernorm as a separate norm, read by the q and kv down-projections;
    plain attention fuses it into the QKV LayerNormLinear, an IdentityOp). Its output, h wide
    (sequence-split under SP); 0 without MLA."""
    return ctx.seq * la.mb_share * ctx.hidden / la.sp_div * (1.0 if ctx.mla_up_params else 0.0)


def per_op_saved_bytes(ctx: CostContext, la: LayoutArrays):
    """Bytes a dense layer keeps per micro-batch under a per-op selective policy (`RunsAs.selective`
    per-op: torchtitan's SelectiveAC, distributed/activation_checkpoint.py): the block's input (the
    checkpoint's, h wide, sequence-split under SP), the outputs of the 1st, 3rd, ... linear of the
    block as torchtitan builds it (fused QKV, `emit.torchtitan` writes fuse_qkv: wqkv, then w1,
    then SwiGLU's down-projection w2, whose partial sums are h wide on every tp rank; wo and w3
    are dropped), the attention kernel's output (q_dim / tp) and, with tp > 1, the two
    reduce-scatters' outputs (h / tp each). Norms, RoPE, the activation and the dropped linears are
    recomputed."""
    sb = ctx.seq * la.mb_share
    linears = ctx.q_dim + 2 * ctx.kv_dim + ctx.ffn  # wqkv and the MLP's first (w1 / fc1), split by tp
    elements = (sb * ctx.hidden / la.sp_div + sb * (linears + ctx.q_dim) / la.tp
                + (sb * ctx.hidden if ctx.mlp_mats == 3 else 0.0)
                + np.where(la.tp > 1, 2 * sb * ctx.hidden / la.tp, 0.0))
    return elements * ctx.act_bytes


def mla_up_discarded_elements(ctx: CostContext, la: LayoutArrays):
    """Elements per layer and micro-batch that Megatron-Core's mla_up_proj recompute (`mla-up`)
    does not keep: the per-head Q, K and V the up-projections build from the latents
    (q_dim + 2 kv_dim per token over tp, `context._attention_fields`), an output-discarding
    checkpoint that frees them once the attention kernel has saved its reference and rebuilds them
    in the backward (MultiLatentAttention: qkv_up_checkpoint.discard_output_and_register_recompute).
    The latents the up-projections save as their input stay (not counted either way)."""
    return ctx.seq * la.mb_share * (ctx.q_dim + 2 * ctx.kv_dim) / la.tp


def moe_block_discarded_bytes(ctx: CostContext, la: LayoutArrays):
    """Bytes per MoE layer and micro-batch that Megatron-Core's moe recompute (`--recompute-modules
    moe layernorm`) does not keep: everything the MoE block of `moe_layer_activation_bytes` stores
    (the shared experts' and routed experts' FFN tensors, the permuted tokens, the experts' output
    the combine keeps, the router's
    logits and probabilities: MoELayer.forward runs under one tensor_parallel.checkpoint, which
    keeps only its input) and that input, the pre-MLP norm's output (an output-discarding
    checkpoint of the layernorm module, as in moe-act). The attention half of the layer is kept."""
    norm_output = ctx.seq * la.mb_share * ctx.hidden / la.sp_div
    return moe_block_bytes(ctx, la) + norm_output * ctx.act_bytes


def offloaded_bytes(ctx: CostContext, la: LayoutArrays):
    """(dense layer, MoE layer) bytes per micro-batch that activation offloading (`RunsAs.act_offload`,
    Megatron-Core --fine-grained-activation-offloading) moves to host memory in the forward and back
    before the backward: what the offloaded modules save (FineGrainedActivationOffloadingInterface
    hooks the saved tensors of each module), as `layer_activation_bytes` and
    `moe_layer_activation_bytes` count them.
    - experts (MoE layers): expert_fc1, the permuted tokens the experts' FC1 saves (routed x h x
      etp / tp, in FP8 under fp8), and moe_act, the FC1 output the activation saves (mlp_mats - 1
      of the experts' FFN tensors: SwiGLU's gate and up, GELU's input);
    - attention (every layer): qkv_linear, the fused norm's input and output (2 of the 4 h-wide
      tensors of `norm_mask_bytes`, the output in FP8 under fp8), core_attn, Q, K, V and the output,
      and attn_proj, the output as the projection saves it (2 q_dim + 2 kv_dim per token over tp,
      the projection's input in FP8 under fp8).
    Net of what the layout's recompute already drops (a tensor is moved only if it is kept):
    mla-up's per-head Q, K, V and the layernorm module's MLA input-norm output.
    Zero without offloading."""
    sb = ctx.seq * la.mb_share
    fp8 = 1.0 if ctx.fp8 else 0.0  # one byte less per element Transformer Engine saves in FP8
    norm_side = sb * ctx.hidden / la.sp_div
    norm_modes = recomputes_module(la, "layernorm")
    qkv_linear = (2 * ctx.act_bytes - fp8) * norm_side - np.where(
        norm_modes, input_norm_discarded_elements(ctx, la) * ctx.act_bytes, 0.0)
    core = sb * ((2 * ctx.q_dim + 2 * ctx.kv_dim) * ctx.act_bytes - fp8 * ctx.q_dim) / la.tp - np.where(
        la.recompute == RECOMPUTE_CODES["mla-up"], mla_up_discarded_elements(ctx, la) * ctx.act_bytes, 0.0)
    attention = np.maximum(qkv_linear, 0.0) + np.maximum(core, 0.0)
    attention = attention if ctx.offload_attention else 0.0 * attention
    if not ctx.moe_layers or not ctx.offload_experts:
        return attention, attention
    routed = routed_tokens(ctx, la)
    experts = (routed * la.expert_tp / la.tp * ctx.hidden * (ctx.act_bytes - fp8)
               + routed * ctx.expert_ffn * (ctx.mlp_mats - 1) / la.tp * ctx.act_bytes)
    return attention, attention + experts


OFFLOAD_RESIDENT_LAYERS = 2  # offloaded layers still on the GPU at the peak (`stage_activation_bytes`)


def host_offload_bytes(ctx: CostContext, la: LayoutArrays, pp_rank, layers_on_rank, moe_on_rank=0.0,
                       recompute_share=0.0):
    """Host memory one rank's offloaded activations take at its peak (`offloaded_bytes` of every
    layer it keeps, but the OFFLOAD_RESIDENT_LAYERS left on the GPU): Megatron-Core copies them
    into a pinned host pool (OffloadTensorPool). Not GPU memory; 0 without offloading."""
    off_dense, off_moe = offloaded_bytes(ctx, la)
    flight = in_flight(ctx, la, pp_rank)
    kept = flight * ((layers_on_rank - moe_on_rank) * off_dense + moe_on_rank * off_moe) * (1 - recompute_share)
    resident = resident_offload_bytes(la, flight, layers_on_rank, moe_on_rank, recompute_share, off_dense, off_moe)
    return np.where(la.recompute >= RECOMPUTE_CODES["full"], 0.0, np.maximum(kept - resident, 0.0))


def resident_offload_bytes(la: LayoutArrays, flight, layers_on_rank, moe_on_rank, share, off_dense, off_moe):
    """The offloaded bytes still on the GPU at the peak: OFFLOAD_RESIDENT_LAYERS layers' worth (at
    most the layers in flight), of the non-recomputed share; none under full recompute."""
    layers = np.minimum(OFFLOAD_RESIDENT_LAYERS, flight * layers_on_rank) * (1 - share)
    per_layer = np.where(moe_on_rank > 0, np.maximum(off_dense, off_moe), off_dense)
    return np.where(la.recompute >= RECOMPUTE_CODES["full"], 0.0, layers * per_layer)


def in_flight(ctx: CostContext, la: LayoutArrays, pp_rank):
    """Micro-batches whose activations rank `pp_rank` holds at its peak, in units of its full
    stage, as its schedule keeps them (`plan3d.specs.schedule.in_flight`): p - r under 1F1B
    (Narayanan et al. 2021); with v chunks Megatron warms up 2(p - r - 1) + (v - 1)p + 1 chunks,
    i.e. p(1 + (p-1)/(pv)) on the first rank (Korthikanti); p on every rank under ZB-V, p + 1/2
    under DualPipeV. Megatron-Core's combined-1f1b overlap (`RunsAs.ep_overlap`, ep > 1) warms
    up one more chunk (schedules.py get_pp_rank_microbatches)."""
    extra = np.where(ctx.ep_combined_1f1b & (la.ep > 1) & (la.pp > 1), 1.0 / la.vpp, 0.0)
    return np.minimum(schedules.in_flight(la.schedule_codes, la.pp, pp_rank, la.vpp, la.m) + extra, la.m)


def stage_activation_bytes(ctx: CostContext, la: LayoutArrays, pp_rank, layers_on_rank, moe_on_rank=0.0,
                           recompute_share=0.0):
    """Activations at the peak of rank `pp_rank`: in-flight micro-batches times its layers
    (full recompute keeps only each layer's input, 2*s*B*h, plus one layer's working set: the
    larger of a dense and an MoE layer where it has both), and the fp32 logits of one micro-batch
    on the last stage (its seq / cp tokens with context parallelism), at the engine's `logit_bytes` per
    element (the bf16 output, the loss's fp32 copy and what it saves). The logits and the
    recompute working set are never live together: the loss's backward frees what it saved before
    the first layer is recomputed, so the rank holds the larger of the two, not their sum.
    Partial recompute keeps `recompute_share` of the rank's layers as full recompute does and the
    rest as without recompute (`partial_recompute_layers`). Moe recompute keeps an MoE layer
    without its MoE block (`moe_block_discarded_bytes`), which is live again while one layer's
    backward recomputes it. Selective recompute under a per-op policy (`RunsAs.selective`,
    torchtitan) keeps a dense layer's `per_op_saved_bytes`, the rest rebuilt in one layer's
    backward at a time. Mla-up recompute keeps every layer without its per-head Q, K, V
    (`mla_up_discarded_elements`) and an MoE layer also without what moe-act drops; the layernorm
    module of moe-act, moe and mla-up also drops an MLA layer's input-norm output
    (`input_norm_discarded_elements`). Offloaded activations (`offloaded_bytes`) leave every kept layer but
    OFFLOAD_RESIDENT_LAYERS: the last layer of the chunk whose backward comes next, which Megatron-Core
    keeps on the GPU (PipelineOffloadManager's offload margin), and the one reloaded ahead of its
    backward (ChunkOffloadHandler.pre_reload_last_layer); a fully recomputed layer keeps nothing to move."""
    full = la.recompute >= RECOMPUTE_CODES["full"]
    partial = (la.recompute == RECOMPUTE_CODES["partial"]) & (np.asarray(recompute_share) > 0)
    share = np.where(partial, recompute_share, 0.0)
    selective = la.recompute == RECOMPUTE_CODES["selective"]
    per_layer = layer_activation_bytes(ctx, la)
    per_moe = moe_layer_activation_bytes(ctx, la) if ctx.moe_layers else per_layer
    moe_block = la.recompute == RECOMPUTE_CODES["moe"]
    redone_moe = moe_block_discarded_bytes(ctx, la) if ctx.moe_layers else 0.0  # live again in one layer's backward
    mla_up = la.recompute == RECOMPUTE_CODES["mla-up"]
    norm_modes = recomputes_module(la, "layernorm")
    mla_discarded = (np.where(mla_up, mla_up_discarded_elements(ctx, la) * ctx.act_bytes, 0.0)
                     + np.where(norm_modes, input_norm_discarded_elements(ctx, la) * ctx.act_bytes, 0.0))
    per_layer = per_layer - mla_discarded
    if ctx.moe_layers:
        per_moe = per_moe - mla_discarded - np.where(
            recomputes_module(la, "moe_act"), sum(moe_act_discarded_elements(ctx, la)) * ctx.act_bytes, 0.0)
        per_moe = per_moe - np.where(moe_block, redone_moe, 0.0)
    checkpoint = 2 * ctx.seq * la.mb_share * ctx.hidden / la.sp_div * ctx.act_bytes / 2
    scores = np.where(selective, attention_score_store_bytes(ctx, la), 0.0)  # selective recomputes the scores
    per_op = selective & ctx.selective_per_op  # a dense layer keeps only what the per-op policy saves
    saved = np.minimum(per_layer - scores, per_op_saved_bytes(ctx, la)) if ctx.selective_per_op else per_layer - scores
    rebuilt = np.where(per_op & (layers_on_rank > moe_on_rank), per_layer - scores - saved, 0.0)  # one layer's backward
    off_dense, off_moe = offloaded_bytes(ctx, la)
    stored = np.where(full, checkpoint, (1 - share) * (np.where(per_op, saved, per_layer - scores) - off_dense)
                      + share * checkpoint)
    stored_moe = np.where(full, checkpoint, (1 - share) * (per_moe - scores - off_moe) + share * checkpoint)
    flight = in_flight(ctx, la, pp_rank)
    resident = resident_offload_bytes(la, flight, layers_on_rank, moe_on_rank, share, off_dense, off_moe)
    largest = np.where(moe_on_rank > 0, np.maximum(per_layer, per_moe), per_layer)
    working = np.where(full | partial, largest, np.where(moe_block & (moe_on_rank > 0), redone_moe, rebuilt))
    kept = flight * ((layers_on_rank - moe_on_rank) * stored + moe_on_rank * stored_moe) + resident
    logits = np.where(pp_rank == la.last_rank, ctx.seq * la.mb_share * padded_vocab(ctx, la.tp) / la.tp
                      * ctx.logit_bytes, 0.0)
    return kept + np.maximum(working, logits) + pipeline_output_bytes(ctx, la, pp_rank)


def partial_recompute_layers(ctx: CostContext, la: LayoutArrays, pp_rank, layers_on_rank, moe_on_rank, fixed_bytes):
    """Partial recompute (Megatron-Core `--recompute-method block --recompute-num-layers N`): the
    first N layers of every virtual chunk of every pipeline rank are fully recomputed, N the fewest
    that bring the most-loaded rank within `capacity_bytes` (one N for all ranks, as the argument
    is global), at least 1 and at most one fewer than a chunk's layers; 0 where every rank fits
    without recompute (the layout then runs as recompute none). Returns (share, N): each rank's
    share of its layers recomputed and N, per candidate.

    A rank's total is linear in the layers it recomputes: `fixed_bytes` (model states, buffers, the
    reserve's fixed part) plus (1 + allocator overhead) x activations, and each recomputed layer
    keeps only its input (2sBh, /tp under SP) instead of its activations, for every micro-batch in
    flight, while one layer's working set is live in the backward (in place of the logits where
    they are larger)."""
    partial = la.recompute == RECOMPUTE_CODES["partial"]
    none = replace(la, recompute=np.where(partial, RECOMPUTE_CODES["none"], la.recompute))
    act_none = stage_activation_bytes(ctx, none, pp_rank, layers_on_rank, moe_on_rank)
    full = replace(la, recompute=np.where(partial, RECOMPUTE_CODES["full"], la.recompute))
    act_full = stage_activation_bytes(ctx, full, pp_rank, layers_on_rank, moe_on_rank)
    grow = 1 + ctx.allocator_overhead_fraction
    # full recompute = none - every layer's savings + the working set (over the logits): per layer
    # recomputed the rank saves (act_none - act_full + working extra) / layers
    dense = layer_activation_bytes(ctx, la)
    per_layer = np.where(moe_on_rank > 0, np.maximum(dense, moe_layer_activation_bytes(ctx, la)), dense) \
        if ctx.moe_layers else dense  # the working set stage_activation_bytes holds
    logits = np.where(pp_rank == la.last_rank, ctx.seq * la.mb_share * padded_vocab(ctx, la.tp) / la.tp * ctx.logit_bytes, 0.0)
    working_extra = np.maximum(per_layer, logits) - logits
    layers = np.maximum(layers_on_rank, 1.0)
    saved_per_layer = np.maximum((act_none + working_extra - act_full) / layers, 1.0)
    fits_without = fixed_bytes + grow * act_none <= ctx.capacity_bytes  # then nothing is recomputed, no working set
    excess = fixed_bytes + grow * (act_none + working_extra) - ctx.capacity_bytes
    needed = np.where((layers_on_rank > 0) & ~fits_without,
                      np.maximum(np.ceil(np.maximum(excess, 0.0) / (grow * saved_per_layer) / la.vpp), 1.0), 0.0)
    chunk = np.where(layers_on_rank > 0, np.floor(layers_on_rank / la.vpp), np.inf)
    most = np.maximum(np.min(chunk, axis=0, keepdims=True) - 1, 1.0)
    wanted = np.max(needed, axis=0, keepdims=True)
    n = np.where(partial & (wanted > 0), np.clip(wanted, 1.0, most), 0.0)
    share = np.where(layers_on_rank > 0, np.minimum(n * la.vpp, layers_on_rank) / layers, 0.0)
    return share, n


def pipeline_output_bytes(ctx: CostContext, la: LayoutArrays, pp_rank):
    """The stage outputs an engine keeps until their backward (`pipeline_outputs_kept`: DeepSpeed's
    PipelineEngine holds pipe_buffers['outputs'] for every micro-batch in flight, and with tp > 1
    partitions each over the tensor-parallel group, keeping its 1/tp slice: pipe/engine.py
    _exec_forward_pass, `is_pipe_partitioned`): s*B*h/tp per micro-batch in flight on every stage
    but the last. Megatron frees the output's data once sent (`deallocate_output_tensor`;
    Korthikanti et al. 2022, Appendix B: s*b*h*p*2 bytes saved on pipeline rank 0, 2.73 GB for
    their 530B layout)."""
    if not ctx.pipeline_outputs_kept:
        return 0.0 * pp_rank
    boundary = ctx.seq * la.mb_share * ctx.hidden / la.tp * ctx.act_bytes
    return np.where(pp_rank != la.last_rank, in_flight(ctx, la, pp_rank) * boundary, 0.0)


def buffer_bytes(ctx: CostContext, la: LayoutArrays):
    """Communication buffers: pipeline send/receive (forward and backward), the sequence-parallel
    all-gather output, under ZeRO-3 two gathered layers (one in use, one prefetched; for an MoE
    model the larger of a dense layer and an MoE layer with its local experts), with context
    parallelism the ring's K/V buffers (`cp_ring_buffer_bytes`), and with expert parallelism the
    all-to-all's send and receive buffers of one MoE layer (`ep_a2a_buffer_bytes`)."""
    boundary = ctx.seq * la.mb_share * ctx.hidden * ctx.act_bytes
    p2p = np.where(la.pp > 1, 2 * boundary / la.sp_div, 0.0)
    sp_gather = np.where(la.sp > 0, boundary, 0.0)
    layer_full = (layer_params_split(ctx) / la.tp + layer_params_replicated(ctx)) * ctx.weight_bytes
    if ctx.moe_layers:
        moe_full = (moe_layer_params_split(ctx) / la.tp + moe_layer_params_replicated(ctx)
                    + expert_rank_params(ctx, la.expert_tp, la.ep)) * ctx.weight_bytes
        layer_full = np.maximum(layer_full, moe_full)
        p2p = p2p + np.where(la.ep > 1, ep_a2a_buffer_bytes(ctx, la), 0.0)
    return (p2p + sp_gather + np.where(la.zero >= 3, zero3_gathered_bytes(ctx, layer_full), 0.0)
            + np.where(la.cp > 1, cp_ring_buffer_bytes(ctx, la), 0.0))


def zero3_gathered_bytes(ctx: CostContext, layer_bytes):
    """Parameters ZeRO-3 holds gathered at once: two layers (the one computing and the one
    prefetched: FSDP2 units, Megatron-FSDP buckets), or at most the engine's live-parameter cap
    (`zero3_live_params`: DeepSpeed gathers module by module and releases past
    stage3_max_live_parameters, 1e9 elements by default; deepspeed/runtime/zero/config.py)."""
    if not ctx.zero3_live_params:
        return 2 * layer_bytes
    return np.minimum(2 * layer_bytes, ctx.zero3_live_params * ctx.weight_bytes)


def ep_a2a_buffer_bytes(ctx: CostContext, la: LayoutArrays):
    """One MoE layer's dispatch all-to-all: the send and the receive buffer of the routed tokens
    a rank exchanges (its sequence-parallel share: top_k * tokens / sp_div copies of h elements,
    at the busiest rank's load)."""
    return 2 * routed_tokens(ctx, la) * ctx.hidden / la.sp_div * ctx.act_bytes


CP_RING_BUFFERS = 4  # K/V-chunk-sized buffers at the ring's peak (the backward), see cp_ring_buffer_bytes


def cp_kv_chunk_bytes(ctx: CostContext, la: LayoutArrays):
    """One rank's K and V for its share of a micro-batch: 2 * (seq / cp) * mb * kv_dim / tp elements."""
    return 2 * ctx.seq * la.mb_share * ctx.kv_dim / la.tp * ctx.act_bytes


def cp_ring_buffer_bytes(ctx: CostContext, la: LayoutArrays):
    """Context parallelism's communication buffers of the layer being computed, by K/V exchange
    (`CostContext.cp_comm`):
    - p2p: the ring's peak is the backward, which double-buffers (K/V, dK/dV) pairs -- two
      buffers of twice a K/V chunk, i.e. 4 chunks (Transformer Engine AttnFuncWithCPAndKVP2P.backward,
      `p2p_comm_buffers` of shape (2, *kv.shape)); the forward holds two K/V chunks in flight;
    - all_gather: the whole sequence's K/V (cp chunks) and, in the backward, its dK/dV (cp chunks);
      where the gathered K/V are saved (`cp_kv_saved`) they are activations, and only dK/dV remain;
    - a2a: the send and receive buffers of the rank's Q, K, V in the other split (twice their bytes)."""
    chunk = cp_kv_chunk_bytes(ctx, la)
    if ctx.cp_comm == "all_gather":
        return (1 if ctx.cp_kv_saved else 2) * la.cp * chunk
    if ctx.cp_comm == "a2a":
        return 2 * ctx.seq * la.mb_share * (ctx.q_dim + 2 * ctx.kv_dim) / la.tp * ctx.act_bytes
    return CP_RING_BUFFERS * chunk


def cp_saved_kv_bytes(ctx: CostContext, la: LayoutArrays):
    """Bytes one layer saves beyond its own K/V when the other ranks' K/V are saved for the
    backward (`cp_kv_saved`: torch's flex_cp_allgather under torchtitan 0.3; plan3d's runtime,
    whose ring too keeps every block it received): the other cp - 1 ranks' chunks. Zero otherwise
    (Transformer Engine fetches them again in the backward; a2a keeps only head-split tensors of
    the rank's own size)."""
    if ctx.cp_comm == "a2a" or not ctx.cp_kv_saved:
        return 0.0
    return np.maximum(la.cp - 1, 0) * cp_kv_chunk_bytes(ctx, la)


def reserve_row_bytes(ctx: CostContext, activations, buffers):
    """The reserve row: what no formula sees (`reserve_bytes`: CUDA context, NCCL, workspaces) plus
    what the caching allocator holds beyond the live activations and buffers at the peak
    (`allocator_overhead_fraction` of them: freed blocks it keeps cached, fragmentation).
    Model states are allocated once, as flat buffers, and not counted in it."""
    return ctx.reserve_bytes + ctx.allocator_overhead_fraction * (activations + buffers)


def stage_memory(ctx: CostContext, la: LayoutArrays, pp_rank, layers_on_rank, moe_on_rank=0.0) -> dict:
    """Every memory category of one rank of pipeline rank `pp_rank` holding `layers_on_rank`
    layers of which `moe_on_rank` are MoE layers, and their total; `params` is the dense part,
    `expert_params` the routed experts' (ZeRO-sharded over dp*cp and dp*cp/ep respectively)."""
    params = stage_params(ctx, la.tp, la.pp, pp_rank, layers_on_rank, moe_on_rank, la.last_rank)
    experts = moe_on_rank * expert_rank_params(ctx, la.expert_tp, la.ep) if ctx.moe_layers else 0.0 * params
    out = model_states(ctx, params, la.grad_ranks, la.zero, experts, la.expert_grad_ranks, la.pp)
    copies = schedules.column("parameter_copies", la.schedule_codes)  # DualPipe: both directions' copies
    out["weights"], out["gradients"] = out["weights"] * copies, out["gradients"] * copies
    out["buffers"] = (buffer_bytes(ctx, la) + fp8_weight_cache_bytes(ctx, la, layers_on_rank, moe_on_rank)
                      + gradient_work_bytes(ctx, la, params, experts) + 0.0 * pp_rank)
    share, n = 0.0 * pp_rank, 0.0 * la.tp
    if np.any(la.recompute == RECOMPUTE_CODES["partial"]):
        fixed = (out["weights"] + out["gradients"] + out["optimizer"] + out["buffers"]
                 + reserve_row_bytes(ctx, 0.0, out["buffers"]))
        share, n = partial_recompute_layers(ctx, la, pp_rank, layers_on_rank, moe_on_rank, fixed)
    out["activations"] = stage_activation_bytes(ctx, la, pp_rank, layers_on_rank, moe_on_rank, share)
    out["host_offload"] = host_offload_bytes(ctx, la, pp_rank, layers_on_rank, moe_on_rank, share)
    out["reserve"] = reserve_row_bytes(ctx, out["activations"], out["buffers"])
    out["total"] = sum(out[k] for k in ("weights", "gradients", "optimizer", "activations", "buffers", "reserve"))
    out["params"] = params
    out["expert_params"] = experts
    out["recompute_share"] = share  # partial recompute: the share of the rank's layers recomputed
    out["recompute_layers"] = n  # ... and N, layers per virtual chunk (0 unless partial)
    return out


__all__ = ["layout_arrays", "model_state_bytes", "stage_memory", "stage_params"]
