"""GPU spec: memory, peak FLOP/s per dtype, HBM bandwidth, and the compute-efficiency curve.

Units live in field names; the code converts to SI (bytes, FLOP/s) through properties.
"""
from __future__ import annotations

from typing import Literal

from pydantic import Field, PositiveFloat

from plan3d.specs.base import StrictModel

GIB = 2**30
Dtype = Literal["fp32", "tf32", "bf16", "fp16", "fp8"]


class ComputeEfficiency(StrictModel):
    """How close the kernels of one transformer layer get to the datasheet (fitted, not hand-set).

    GEMMs: one GEMM of `w` FLOPs runs at eff(w) = max_fraction * w / (w + half_work_flops) of dense
    peak, i.e. it takes (w + half_work_flops) / (max_fraction * peak): a fixed cost per kernel (tile
    fill, launch, wave quantisation) that makes small per-GPU matrices (large tp, small
    micro-batch * sequence) slow.
    Memory-bound work (norms, bias, activation, dropout, residual, softmax) moves
    `elementwise_bytes` of HBM traffic per activation element a layer's forward touches, and
    `attention_score_bytes` per attention-score element (0 with fused flash attention, whose
    scores never reach HBM; ~10-16 for an unfused softmax + dropout).
    `layer_overhead_s`: fixed time per layer per forward pass (twice that per backward) that no
    FLOP or byte explains: kernel launches and host-side dispatch the GPU waits for when kernels
    are short (dominant for small models and small micro-batches in eager PyTorch).
    `micro_batch_overhead_s`: fixed time per micro-batch per pipeline stage (schedule step,
    loss and data handling on the host, and the blocking pipeline send/receive that drains the
    GPU queue), paid in forward + backward.
    `dp_overlap_fraction`: the share of one micro-batch's backward that hides the data-parallel
    gradient reduction (0 without gradient bucketing, as in the vTrain runs).
    `host_overlap`: whether the host issues work while the device computes (a GPU's asynchronous
    launch queue: a pass costs about the larger of the two) or one core does both in turn (a CPU
    process: the host time and the kernel time add).
    Values are fitted by `benchmarks/accuracy.py` (and later `plan3d calibrate`).
    """

    max_fraction: float = Field(0.75, gt=0, le=1)
    half_work_flops: float = Field(2.0e9, ge=0)
    elementwise_bytes: float = Field(8.0, ge=0)
    attention_score_bytes: float = Field(0.0, ge=0)
    layer_overhead_s: float = Field(1.0e-4, ge=0)
    micro_batch_overhead_s: float = Field(0.0, ge=0)
    dp_overlap_fraction: float = Field(0.8, ge=0, le=1)
    host_overlap: bool = True
    fitted_on: str = Field("", description="The measured data these values were fitted on (empty: datasheet "
                           "defaults, not calibrated).")


class GPUSpec(StrictModel):
    name: str
    memory_gib: PositiveFloat = Field(description="Device memory in GiB (2^30 bytes).")
    peak_tflops: dict[Dtype, PositiveFloat] = Field(
        description="Dense (no sparsity) peak tensor throughput per dtype, in TFLOP/s (1e12)."
    )
    hbm_tbytes_per_s: PositiveFloat = Field(description="HBM bandwidth in TB/s (1e12 bytes/s).")
    reserved_memory_gib: float = Field(
        2.0, ge=0, description="Per-device memory no formula sees: CUDA context, NCCL buffers, "
        "allocator fragmentation. A property of the device and its software stack."
    )
    compute_efficiency: ComputeEfficiency = ComputeEfficiency()
    source: str = ""

    @property
    def memory_bytes(self) -> float:
        return self.memory_gib * GIB

    def peak_flops(self, dtype: str) -> float:
        """Peak FLOP/s for `dtype`; fp8 falls back to bf16 where the GPU has no fp8 units."""
        if dtype in self.peak_tflops:
            return self.peak_tflops[dtype] * 1e12
        for fallback in ("bf16", "fp16", "tf32", "fp32"):
            if fallback in self.peak_tflops:
                return self.peak_tflops[fallback] * 1e12
        raise AssertionError("GPUSpec without any peak_tflops entry")
