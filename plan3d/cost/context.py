"""The fixed part of an estimate: model shapes, dtype sizes and hardware rates, as plain floats.

Built once per (cluster, model, training); every cost formula reads it, so that the scalar
`estimate()` and the vectorised `estimate_batch()` run the very same arithmetic.
"""
from __future__ import annotations

from dataclasses import dataclass

from plan3d.cost.fp8 import compute_dtype, fp8_fields
from plan3d.cost.params import norm_params
from plan3d.specs.cluster import ClusterSpec
from plan3d.specs.engine import ACT_OFFLOAD_MODULES, HIERARCHICAL_DISPATCHERS, EngineSpec, grad_dtype
from plan3d.specs.gpu import GPUSpec
from plan3d.specs.model import ModelSpec
from plan3d.specs.training import TrainingSpec

GIB = 2**30


@dataclass(frozen=True)
class CostContext:
    # model shapes
    layers: int
    hidden: int
    heads: int
    q_dim: int  # heads * head_dim
    kv_dim: int  # kv_heads * head_dim
    ffn: int
    mlp_mats: int  # 2 (GELU/ReLU) or 3 (SwiGLU)
    vocab: int
    seq: int  # training sequence length
    position_params: int  # learned positions (replicated over tp), on the first stage
    norm_params: int
    bias: bool
    qkv_bias: bool
    tied: bool
    # training
    global_batch: int
    act_bytes: int  # bytes of one activation element (2 in 16-bit, 4 in fp32)
    weight_bytes: int
    grad_bytes: int  # the gradient buffer's dtype (what accumulates and what the reduction moves)
    optim_bytes: int
    reserve_bytes: float
    capacity_bytes: float
    # hardware
    peak_flops: float
    hbm_bytes_per_s: float
    gemm_max_fraction: float
    gemm_half_work_flops: float
    elementwise_bytes: float
    attention_score_bytes: float
    layer_overhead_s: float
    micro_batch_overhead_s: float
    dp_overlap_fraction: float
    host_overlap: bool = True
    zero3_overlap_fraction: float | None = None  # None: dp_overlap_fraction
    zero3_per_gpu_nic: bool = False  # ZeRO-3 collectives get one NIC share per GPU, not the node's rings
    tp_overlap_fraction: float = 0.0  # share of TP collectives hidden behind GEMMs
    tp_overlap_off_zero: tuple = ()  # ZeRO stages with which this engine cannot hide them on this GPU (RunsAs.tp_overlap_conflict)
    param_gather_overlap: bool = False  # ZeRO-1/2 weight all-gather hidden behind the first forward
    cpu_cores_per_node: int = 0  # CPU "GPUs": the cores a node's ranks share (0: not shared)
    gpus_per_node: int = 1
    fp8_peak_flops: float = 0.0  # fp8 training: the linear-layer GEMMs' peak (0: no fp8; plan3d.cost.fp8)
    fp8_max_fraction: float = 0.0
    fp8_cast_bytes: float = 0.0
    ep_overlap_fraction: float = 0.0  # share of the expert-parallel all-to-alls hidden behind compute
    ep_combined_1f1b: bool = False  # the all-to-alls hide behind another micro-batch (RunsAs.ep_overlap)
    ep_hierarchical: bool = False  # the dispatcher sends a token once per node it reaches (RunsAs.ep_dispatcher)
    shared_expert_overlap: bool = False  # the shared experts hide the all-to-alls up to their own time
    f_b_overlap: bool = False  # a paired-chunk schedule's forward and backward run concurrently (RunsAs.f_b_overlap)
    f_b_comm_sm_share: float = 0.0  # share of the SMs the overlapped all-to-alls take from the GEMMs then
    cp_comm: str = "p2p"  # context parallelism's K/V exchange: p2p ring, all_gather or a2a (EngineSpec RunsAs.cp_comm)
    cp_kv_saved: bool = False  # all_gather: the gathered K/V are saved for the backward (no second gather)
    cp_ring_overlap: bool = True  # p2p: each ring transfer overlaps a block of attention
    fp8: bool = False  # fp8 training: FP8 weight caches and FP8-saved GEMM inputs (plan3d.cost.memory)
    dropout: bool = False  # the model trains with dropout: 1-byte masks are saved (plan3d.cost.memory)
    attention_work: float = 1.0  # share of the s^2 score work the attention kernel does (`causal_attention_work`)
    scores_stored: bool = False  # unfused attention: the softmax output (and dropout mask and output) is saved
    flash_attention: bool = False  # the engine's attention is a flash kernel (its backward recomputes the scores)
    grad_dtype: str = "fp32"  # the gradient buffer's dtype (`grad_dtype`)
    grad_label: str = "fp32"  # the gradients as budgeted, for display: "fp32", "bf16", "fp32 + bf16 .grad"
    grad_copy_bytes: int = 0  # 16-bit .grad tensors kept next to an fp32 buffer (DeepSpeed BF16_Optimizer), per parameter
    step_grad_cast_bytes: int = 0  # fp32 copy of 16-bit gradients the optimizer step makes, per parameter it updates
    unsharded_step_cast_bytes: int = 0  # the same at ZeRO-0, where the engine's step may hold two (GradientBuffer)
    reduce_bucket_elements: float = 0.0  # flat bucket the gradient reduction copies into (DeepSpeed), in elements
    pipeline_outputs_kept: bool = False  # each stage keeps its output of every micro-batch in flight (DeepSpeed)
    zero3_collectives_per_layer: float = 1.0  # ZeRO-3 gathers / reduce-scatters per layer and pass
    zero3_live_params: float = 0.0  # ZeRO-3: parameters gathered at once, at most (0: two whole layers)
    zero3_recompute_regathers: bool = True  # full recompute gathers the weights a third time (RunsAs)
    selective_per_op: bool = False  # selective recompute is torchtitan's per-op SelectiveAC (RunsAs.selective)
    logit_bytes: float = 4.0  # bytes per logit element at the loss's peak (engine runs_as.logit_bytes)
    moe_combine_output_bytes: float = 2.0  # bytes per routed-output element the combine keeps (RunsAs)
    fsdp_unsharded_with_pp: bool = False  # pp > 1: FSDP keeps weights gathered and fp32 grads unsharded
    allocator_overhead_fraction: float = 0.0  # allocator's cache beyond live activations and buffers, as a share
    offload_experts: bool = False  # the routed experts' FC1 and activation inputs go to host memory (RunsAs.act_offload)
    offload_attention: bool = False  # the attention's QKV, core and projection inputs go to host memory
    host_bytes_per_s: float = 0.0  # GPU <-> host memory, per direction (GPUSpec.host_link_gbytes_per_s)
    # attention as the weights see it (`_attention_fields`: plain or multi-head latent attention)
    attn_weight_params: int = 0  # weight-matrix parameters of one attention block (its linear GEMMs)
    attn_split: int = 0  # attention parameters tensor parallelism divides (column/row-parallel weights, column biases)
    attn_replicated: int = 0  # attention parameters every tp rank holds (row-parallel bias, MLA down-projections)
    attn_extra_gemms: int = 0  # linear GEMMs beyond fused QKV and the output projection (MLA latents)
    score_dim: float = 0.0  # (Q.K width + V width) / 2 per token over all heads: q_dim without MLA
    mla_up_params: int = 0  # MLA's up-projections (latent -> per-head Q, K, V), which mla-up recompute reruns
    # mixture of experts (`_moe_fields`; all zero for a dense model)
    moe_layers: int = 0  # MoE layers of the whole model
    experts: int = 0  # routed experts per MoE layer
    top_k: int = 0
    router_groups: int = 1  # group-limited routing: the experts' groups, and the best groups a token may use
    router_group_top_k: int = 1
    expert_ffn: int = 0  # FFN width of one routed expert
    shared_ffn: int = 0  # total FFN width of the shared experts
    moe_load: float = 1.0  # tokens the busiest expert-parallel rank computes, over the even share (`moe_load_factor`)
    moe_shared_split: int = 0  # shared experts' parameters tp divides
    moe_replicated: int = 0  # router (+ bias), shared gate, shared experts' row-parallel bias: every tp rank
    expert_split: int = 0  # one routed expert's parameters tp divides (ETP = tp)
    expert_replicated: int = 0  # one routed expert's down-projection bias


DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def bytes_per_param(training: TrainingSpec, engine: EngineSpec | None = None) -> tuple[int, int, int]:
    """(weights, gradients, optimizer) bytes per parameter.

    fp32: 4 + 4 + 8 (Adam m, v). Mixed precision: 2 + the gradient buffer (4 in fp32, 2 in 16 bits:
    `grad_dtype`, the engine's unless the training spec says) + 12 (fp32 master, m, v) -- the 16 vs
    18 bytes of cost-model.md. SGD keeps no moments (mixed precision: the fp32 master only).
    """
    sgd = training.optimizer == "sgd"
    grads = DTYPE_BYTES[grad_dtype(training, engine)]
    if training.precision == "fp32":
        return 4, 4, 0 if sgd else 8
    return 2, grads, 4 if sgd else 12


def gradient_extras(training: TrainingSpec, engine: EngineSpec | None) -> dict:
    """The engine's gradient memory beyond the buffer, per parameter (`CostContext` fields):
    - grad_copy_bytes: 2 where the engine keeps the 16-bit .grad tensors next to an fp32 buffer
      (DeepSpeed BF16_Optimizer: deepspeed/runtime/bf16_optimizer.py adds each bf16 grad into
      `fp32_groups_gradients_flat` and zeroes it; BigScience's tr11 prequel, 'Rebalancing layers':
      "The additional memory usage is 4bytes x params and it's not sharded across gpus");
    - step_grad_cast_bytes: 4 where mixed-precision gradients are 16-bit: the fp32 optimizer step
      reads an fp32 copy of the gradients it updates (Megatron's Float16Optimizer
      `main_param.grad = model_param.main_grad.float()`, its distributed optimizer per shard;
      DeepSpeed stage_1_and_2.py `single_grad_partition = ... .to(fp32)`), sharded as the optimizer;
    - unsharded_step_cast_bytes: that copy without ZeRO, 8 where the engine's step holds two
      (`GradientBuffer.unsharded_step_cast_bytes`: DeepSpeed's FP16_Optimizer)."""
    dtype = grad_dtype(training, engine)
    mixed = training.precision != "fp32"
    cast = 4 if mixed and dtype != "fp32" else 0
    keeps = bool(engine and engine.runs_as.gradients.keeps_16bit_grads)
    copy = mixed and dtype == "fp32" and keeps
    half = "fp16" if training.precision == "fp16" else "bf16"
    return {"grad_dtype": dtype, "grad_copy_bytes": 2 if copy else 0, "grad_label": f"{dtype} + {half} .grad" if copy else dtype,
            "step_grad_cast_bytes": cast,
            "unsharded_step_cast_bytes": engine.runs_as.gradients.unsharded_step_cast_bytes if engine and cast else cast}


def tp_overlap_off_zero(runs_as, generation: str) -> tuple:
    """The ZeRO stages with which the engine's TP overlap is off on this GPU generation."""
    conflict = runs_as.tp_overlap_conflict if runs_as is not None else None
    return tuple(conflict.zero) if conflict is not None and generation in conflict.generations else ()


def combine_output_bytes(runs_as, precision: str) -> float:
    """Bytes per element of the experts' output the MoE combine keeps (`RunsAs.moe_combine_output_bytes`;
    empty: the activation dtype's)."""
    stated = runs_as.moe_combine_output_bytes if runs_as else None
    return float(stated) if stated is not None else (4.0 if precision == "fp32" else 2.0)


def make_context(cluster: ClusterSpec | None, model: ModelSpec, training: TrainingSpec,
                 engine: EngineSpec | None = None) -> CostContext:
    """The context of one (cluster, model, training) as `engine` runs it; cluster None leaves the
    hardware at zero (enough for memory formulas, which do not depend on the hardware).

    The GPU spec gives the hardware values (peak, HBM, GEMM efficiency curve); the engine's
    fitted software values (non-GEMM bytes, host overheads, overlap) replace the GPU spec's where
    the engine sets them. No engine: the GPU spec's values alone (a calibrated cluster)."""
    if cluster is None:
        return CostContext(**_model_fields(model, training, engine), reserve_bytes=reserve_bytes(None, training, engine),
                           capacity_bytes=0.0, peak_flops=0.0,
                           hbm_bytes_per_s=0.0, gemm_max_fraction=1.0, gemm_half_work_flops=0.0,
                           elementwise_bytes=0.0, attention_score_bytes=0.0, layer_overhead_s=0.0,
                           micro_batch_overhead_s=0.0,
                           dp_overlap_fraction=0.0)
    eff = cluster.gpu.compute_efficiency
    if engine is not None:
        eff = eff.model_copy(update=engine.software_values())
    runs_as = engine.runs_as if engine is not None else None
    max_fraction = eff.max_fraction * (engine.efficiency.gemm_efficiency_scale if engine else 1.0)
    return CostContext(
        **_model_fields(model, training, engine),
        reserve_bytes=reserve_bytes(cluster, training, engine),
        capacity_bytes=cluster.gpu.memory_bytes * (1 - training.memory_headroom_fraction),
        peak_flops=cluster.gpu.peak_flops(compute_dtype(training.precision)),
        **fp8_fields(cluster.gpu, eff, max_fraction, training),
        hbm_bytes_per_s=cluster.gpu.hbm_tbytes_per_s * 1e12,
        gemm_max_fraction=max_fraction,
        gemm_half_work_flops=eff.half_work_flops,
        elementwise_bytes=eff.elementwise_bytes, attention_score_bytes=eff.attention_score_bytes,
        layer_overhead_s=eff.layer_overhead_s, micro_batch_overhead_s=eff.micro_batch_overhead_s,
        dp_overlap_fraction=eff.dp_overlap_fraction,
        host_overlap=eff.host_overlap,
        zero3_overlap_fraction=runs_as.zero3_overlap_fraction if runs_as else None,
        zero3_per_gpu_nic=bool(runs_as and runs_as.zero3_collectives == "per-gpu-nic"),
        tp_overlap_fraction=runs_as.tp_overlap_fraction if runs_as else 0.0,
        tp_overlap_off_zero=tp_overlap_off_zero(runs_as, cluster.gpu.generation_name),
        param_gather_overlap=bool(runs_as and runs_as.param_gather_overlap),
        ep_overlap_fraction=runs_as.ep_overlap_fraction if runs_as else 0.0,
        ep_hierarchical=bool(runs_as and runs_as.ep_dispatcher in HIERARCHICAL_DISPATCHERS),
        ep_combined_1f1b=bool(runs_as and runs_as.combined_1f1b),
        shared_expert_overlap=bool(runs_as and runs_as.shared_expert_overlap and not runs_as.combined_1f1b),  # Megatron runs one or the other
        f_b_overlap=bool(runs_as and runs_as.f_b_overlap),
        f_b_comm_sm_share=runs_as.f_b_comm_sm_share if runs_as else 0.0,
        cp_comm=runs_as.cp_comm if runs_as else "p2p",
        cp_kv_saved=bool(runs_as and runs_as.cp_gathered_kv_saved),
        cp_ring_overlap=runs_as.cp_ring_overlap if runs_as else True,
        cpu_cores_per_node=cluster.cpu_cores_per_node or 0,
        gpus_per_node=cluster.gpus_per_node,
        host_bytes_per_s=cluster.gpu.host_link_gbytes_per_s * 1e9,
    )


def offload_fields(act_offload: str) -> dict:
    """The CostContext offload flags of an engine's `act_offload` (ACT_OFFLOAD_MODULES)."""
    modules = ACT_OFFLOAD_MODULES[act_offload]
    return dict(offload_experts="expert_fc1" in modules, offload_attention="core_attn" in modules)


def _model_fields(model: ModelSpec, training: TrainingSpec, engine: EngineSpec | None = None) -> dict:
    weights, grads, optim = bytes_per_param(training, engine)
    runs_as = engine.runs_as if engine is not None else None
    return dict(
        layers=model.layers, hidden=model.hidden, heads=model.heads,
        **_attention_fields(model), **_moe_fields(model),
        ffn=model.ffn_hidden_, mlp_mats=3 if model.activation == "swiglu" else 2,
        vocab=model.vocab, seq=training.seq_len or model.seq_len,
        position_params=model.seq_len * model.hidden if model.position == "learned" else 0,
        norm_params=norm_params(model), bias=model.bias, qkv_bias=model.qkv_bias_, tied=model.tied_embeddings,
        global_batch=training.global_batch, act_bytes=4 if training.precision == "fp32" else 2,
        fp8=training.precision == "fp8", dropout=model.dropout > 0,
        scores_stored=bool(runs_as and runs_as.attention == "unfused"),
        flash_attention=bool(runs_as and runs_as.attention == "flash"),
        attention_work=causal_attention_work(training.seq_len or model.seq_len) if runs_as and runs_as.attention == "flash" else 1.0,
        weight_bytes=weights, grad_bytes=grads, optim_bytes=optim, **gradient_extras(training, engine),
        reduce_bucket_elements=runs_as.reduce_bucket_elements if runs_as else 0.0,
        pipeline_outputs_kept=bool(runs_as and runs_as.pipeline_outputs_kept),
        zero3_live_params=runs_as.zero3_live_params if runs_as else 0.0,
        zero3_recompute_regathers=runs_as.zero3_recompute_regathers if runs_as else True,
        selective_per_op=bool(runs_as and runs_as.selective == "per-op"),
        zero3_collectives_per_layer=runs_as.zero3_collectives_per_layer if runs_as else 1.0,
        logit_bytes=runs_as.logit_bytes if runs_as else 4.0,
        moe_combine_output_bytes=combine_output_bytes(runs_as, training.precision),
        **offload_fields(runs_as.act_offload if runs_as else "none"),
        fsdp_unsharded_with_pp=bool(runs_as and runs_as.fsdp_unsharded_with_pp),
        allocator_overhead_fraction=engine.efficiency.allocator_overhead_fraction if engine else 0.0,
    )


def _attention_fields(model: ModelSpec) -> dict:
    """Attention shapes. Plain (GQA) attention: Q and O of heads*head_dim, K and V of
    kv_heads*head_dim, Q/K/V column-parallel, O row-parallel (Shoeybi et al. 2019).

    Multi-head latent attention (DeepSeek-V2, arXiv 2405.04434, section 2.1; Megatron-Core
    MLASelfAttention): the down-projections h -> q_lora and h -> kv_lora + rope and their RMSNorms
    are replicated over tp (Megatron-Core builds them `duplicated`), the up-projections are
    column-parallel and the output projection heads*v_head -> h row-parallel. For activations,
    FLOPs and the CP ring the per-head Q and K are nope + rope wide and V v_head wide, as the
    up-projections materialise them for the attention kernel: q_dim = heads*(nope + rope),
    kv_dim = heads*(nope + rope + v_head) / 2 (so that K + V = 2*kv_dim). An approximation: the
    latent tensors themselves (kv_lora per token) are not counted as activations."""
    h = model.hidden
    if model.mla is None:
        q, kv = model.heads * model.head_dim_, model.kv_heads_ * model.head_dim_
        weights = h * (q + 2 * kv) + q * h
        return dict(q_dim=q, kv_dim=kv, attn_weight_params=weights, attn_split=weights + (q + 2 * kv) * model.qkv_bias_,
                    attn_replicated=h * model.bias, attn_extra_gemms=0, score_dim=q, mla_up_params=0)
    mla, a = model.mla, model.heads
    qk, v = mla.qk_nope_head_dim + mla.qk_rope_head_dim, mla.v_head_dim
    q_down = h * mla.q_lora_rank if mla.q_lora_rank else 0
    q_up = (mla.q_lora_rank or h) * a * qk
    kv_down = h * (mla.kv_lora_rank + mla.qk_rope_head_dim)
    kv_up = mla.kv_lora_rank * a * (mla.qk_nope_head_dim + v)
    split = q_up + kv_up + a * v * h
    return dict(q_dim=a * qk, kv_dim=a * (qk + v) / 2, attn_weight_params=split + q_down + kv_down,
                attn_split=split, attn_replicated=q_down + (mla.q_lora_rank or 0) + kv_down + mla.kv_lora_rank,
                attn_extra_gemms=1 + (mla.q_lora_rank is not None), score_dim=a * (qk + v) / 2,
                mla_up_params=q_up + kv_up)


# The load the busiest expert-parallel rank gets, over the mean: a stated prior, neither fitted nor
# measured. Balanced routing keeps per-expert token counts near the mean (DeepSeek-V3, arXiv
# 2412.19437, section 2.1.2, auxiliary-loss-free balancing; Switch Transformer, arXiv 2101.03961,
# section 2.2, trains with capacity factors 1.0-1.25); 10% above it is assumed. Every rank waits
# for the busiest at the combine all-to-all, so the time model pays it.
MOE_IMBALANCE = 1.1


def moe_load_factor(model: ModelSpec) -> float:
    """Tokens an expert-parallel rank computes, as a multiple of its even share top_k*tokens/ep:
    the capacity factor when one is set (Megatron-Core pads each expert to its capacity with
    --moe-pad-expert-input-to-capacity; without padding the capacity caps the busiest expert at
    the same figure), else a stated `load_factor` (forced balance: 1.0, or a measured imbalance),
    else the MOE_IMBALANCE prior of dropless routing."""
    cf = model.moe.capacity_factor
    if cf is not None:
        return float(cf)
    return float(model.moe.load_factor) if model.moe.load_factor is not None else MOE_IMBALANCE


FLASH_BLOCK = 128  # query/key tile of FlashAttention-2/3 (Dao 2023, Shah et al. 2024): the diagonal tiles run whole


def causal_attention_work(seq: int) -> float:
    """Share of the s^2 score work a flash-attention kernel does under a causal mask: it skips the
    tiles above the diagonal and computes the diagonal ones whole, (s/b)(s/b + 1)/2 of (s/b)^2
    tiles, b = FLASH_BLOCK (Dao 2023, FlashAttention-2 sec. 3.1.1, "causal masking"). An unfused
    kernel computes the whole score matrix and masks it afterwards (work 1). The model FLOPs that
    MFU counts are a convention (`compute.model_flops_per_step`), this is the time."""
    tiles = max(seq / FLASH_BLOCK, 1.0)
    return min(1.0, (tiles + 1) / (2 * tiles))


def _moe_fields(model: ModelSpec) -> dict:
    """The MoE layer's shapes split as the shared accounting contract splits them (cost-model.md,
    "Mixture of experts"): the dense part (router, shared experts, shared gate) and one routed expert."""
    moe = model.moe
    if moe is None:
        return {}
    h, mats, bias = model.hidden, 3 if model.activation == "swiglu" else 2, int(model.bias)
    fe, fs = moe.expert_ffn_hidden or model.ffn_hidden_, moe.shared_ffn_hidden
    return dict(moe_layers=model.moe_layers, experts=moe.experts, top_k=moe.top_k, expert_ffn=fe, shared_ffn=fs,
                router_groups=moe.router_groups or 1, router_group_top_k=moe.router_group_top_k or 1,
                moe_load=moe_load_factor(model),
                moe_shared_split=(mats * h * fs + (mats - 1) * fs * bias) if fs else 0,
                moe_replicated=h * moe.experts + moe.experts * bias + h * moe.shared_expert_gate + (h * bias if fs else 0),
                expert_split=mats * h * fe + (mats - 1) * fe * bias, expert_replicated=h * bias)


def reserve_bytes(cluster: ClusterSpec | None, training: TrainingSpec, engine: EngineSpec | None = None) -> float:
    """Memory no formula sees: the training spec's override, else the engine's fitted figure,
    else the GPU's own."""
    if training.reserved_memory_gib is not None:
        return training.reserved_memory_gib * GIB
    if engine is not None and engine.efficiency.reserved_memory_gib is not None:
        return engine.efficiency.reserved_memory_gib * GIB
    gpu_reserve = cluster.gpu.reserved_memory_gib if cluster is not None else GPUSpec.model_fields[
        "reserved_memory_gib"].default
    return gpu_reserve * GIB
