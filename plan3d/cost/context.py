"""The fixed part of an estimate: model shapes, dtype sizes and hardware rates, as plain floats.

Built once per (cluster, model, training); every cost formula reads it, so that the scalar
`estimate()` and the vectorised `estimate_batch()` run the very same arithmetic.
"""
from __future__ import annotations

from dataclasses import dataclass

from plan3d.cost.fp8 import compute_dtype, fp8_fields
from plan3d.cost.params import norm_params
from plan3d.specs.cluster import ClusterSpec
from plan3d.specs.engine import EngineSpec
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
    grad_bytes: int
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
    param_gather_overlap: bool = False  # ZeRO-1/2 weight all-gather hidden behind the first forward
    cpu_cores_per_node: int = 0  # CPU "GPUs": the cores a node's ranks share (0: not shared)
    gpus_per_node: int = 1
    fp8_peak_flops: float = 0.0  # fp8 training: the linear-layer GEMMs' peak (0: no fp8; plan3d.cost.fp8)
    fp8_max_fraction: float = 0.0
    fp8_cast_bytes: float = 0.0


def bytes_per_param(training: TrainingSpec) -> tuple[int, int, int]:
    """(weights, gradients, optimizer) bytes per parameter.

    fp32: 4 + 4 + 8 (Adam m, v). Mixed precision: 2 + (4 if fp32 gradient accumulation else 2)
    + 12 (fp32 master, m, v) -- the 16 vs 18 bytes of cost-model.md. SGD keeps no moments
    (mixed precision: the fp32 master only).
    """
    sgd = training.optimizer == "sgd"
    if training.precision == "fp32":
        return 4, 4, 0 if sgd else 8
    return 2, 4 if training.fp32_grad_accum else 2, 4 if sgd else 12


def make_context(cluster: ClusterSpec | None, model: ModelSpec, training: TrainingSpec,
                 engine: EngineSpec | None = None) -> CostContext:
    """The context of one (cluster, model, training) as `engine` runs it; cluster None leaves the
    hardware at zero (enough for memory formulas, which do not depend on the hardware).

    The GPU spec gives the hardware values (peak, HBM, GEMM efficiency curve); the engine's
    fitted software values (non-GEMM bytes, host overheads, overlap) replace the GPU spec's where
    the engine sets them. No engine: the GPU spec's values alone (a calibrated cluster)."""
    if cluster is None:
        return CostContext(**_model_fields(model, training), reserve_bytes=reserve_bytes(None, training),
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
        **_model_fields(model, training),
        reserve_bytes=reserve_bytes(cluster, training),
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
        param_gather_overlap=bool(runs_as and runs_as.param_gather_overlap),
        cpu_cores_per_node=cluster.cpu_cores_per_node or 0,
        gpus_per_node=cluster.gpus_per_node,
    )


def _model_fields(model: ModelSpec, training: TrainingSpec) -> dict:
    weights, grads, optim = bytes_per_param(training)
    return dict(
        layers=model.layers, hidden=model.hidden, heads=model.heads,
        q_dim=model.heads * model.head_dim_, kv_dim=model.kv_heads_ * model.head_dim_,
        ffn=model.ffn_hidden_, mlp_mats=3 if model.activation == "swiglu" else 2,
        vocab=model.vocab, seq=training.seq_len or model.seq_len,
        position_params=model.seq_len * model.hidden if model.position == "learned" else 0,
        norm_params=norm_params(model), bias=model.bias, qkv_bias=model.qkv_bias_, tied=model.tied_embeddings,
        global_batch=training.global_batch, act_bytes=4 if training.precision == "fp32" else 2,
        weight_bytes=weights, grad_bytes=grads, optim_bytes=optim,
    )


def reserve_bytes(cluster: ClusterSpec | None, training: TrainingSpec) -> float:
    """Memory no formula sees: the training spec's override, else the GPU's own figure."""
    if training.reserved_memory_gib is not None:
        return training.reserved_memory_gib * GIB
    gpu_reserve = cluster.gpu.reserved_memory_gib if cluster is not None else GPUSpec.model_fields[
        "reserved_memory_gib"].default
    return gpu_reserve * GIB
