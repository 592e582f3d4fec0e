"""GPU spec: memory, peak FLOP/s per dtype, HBM bandwidth, and the compute-efficiency curve.

Units live in field names; the code converts to SI (bytes, FLOP/s) through properties.
"""
from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator

from plan3d.errors import SpecError
from plan3d.specs.base import (BYTES_PER_ELEMENT, EFFICIENCY, FLOPS, FRACTION, GBYTES_PER_S, MEMORY_GIB, OVERHEAD_S,
                               TBYTES_PER_S, TFLOPS, Name, SpecModel, Text, bounded)

GIB = 2**30
Dtype = Literal["fp32", "tf32", "bf16", "fp16", "fp8"]
FALLBACK_DTYPES = ("bf16", "fp16", "tf32", "fp32")  # in the order a missing dtype falls back


class ComputeEfficiency(SpecModel):
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
    `fp8_gemm_fraction`: under fp8 training, the share of the bf16 GEMM efficiency an fp8 GEMM
    reaches against the fp8 peak (its ceiling is fp8_gemm_fraction * max_fraction of the fp8
    peak). The default is a stated prior: DeepSeek's DeepGEMM announcement (Feb. 2025) reports
    1,350+ FP8 TFLOP/s on Hopper, 68% of the 1,979 dense FP8 peak, where bf16 GEMMs of training
    shapes reach about 75% of 989: 0.68 / 0.75 is about 0.9. The Hopper GPU specs carry 0.73,
    fitted by benchmarks/published.py on five published FP8/BF16 speed-ups of Transformer Engine
    (cuBLAS FP8 GEMMs at training shapes, not DeepGEMM's); other generations keep the prior.
    `mamf_fraction`: the share of the bf16 peak the best-shaped single GEMM reaches on this GPU
    (Maximum Achievable Matmul FLOPS, Bekman's mamf-finder, ml-engineering compute/accelerator
    table: A100 SXM 85.9%, H100 SXM 80.1%, GH200 83.0%, MI300X 60.1%). It is a measured property
    of the device, not of training runs: a generation no training run calibrates gets
    max_fraction = (the A100's fitted max_fraction) * its mamf_fraction / the A100's, the A100
    ceiling carried over by the ratio of what each chip's GEMMs can reach at all
    (benchmarks/published.py ties them the same way when it fits).
    Values are fitted by `benchmarks/accuracy.py` (and later `plan3d calibrate`).
    """

    max_fraction: float = bounded(0.75, EFFICIENCY)
    half_work_flops: float = bounded(2.0e9, FLOPS)
    elementwise_bytes: float = bounded(8.0, BYTES_PER_ELEMENT)
    attention_score_bytes: float = bounded(0.0, BYTES_PER_ELEMENT)
    layer_overhead_s: float = bounded(1.0e-4, OVERHEAD_S)
    micro_batch_overhead_s: float = bounded(0.0, OVERHEAD_S)
    dp_overlap_fraction: float = bounded(0.8, FRACTION)
    host_overlap: bool = True
    fp8_gemm_fraction: float = bounded(0.9, EFFICIENCY)
    mamf_fraction: float | None = bounded(None, EFFICIENCY)
    fitted_on: Text = Field("", description="The measured data these values were fitted on (empty: datasheet "
                           "defaults, not calibrated).")


class GPUSpec(SpecModel):
    name: Name
    memory_gib: float = bounded(..., MEMORY_GIB, description="Device memory in GiB (2^30 bytes).")
    peak_tflops: dict[Dtype, Annotated[float, Field(**TFLOPS)]] = Field(
        description="Dense (no sparsity) peak tensor throughput per dtype, in TFLOP/s (1e12); at least one of "
        "bf16, fp16, tf32, fp32; fp8 training needs an fp8 peak (a GPU without one has no FP8 tensor cores)."
    )
    hbm_tbytes_per_s: float = bounded(..., TBYTES_PER_S, description="HBM bandwidth in TB/s (1e12 bytes/s).")
    reserved_memory_gib: float = bounded(
        2.0, dict(MEMORY_GIB, ge=0), description="Per-device memory no formula sees: CUDA context, NCCL buffers, "
        "allocator fragmentation. A property of the device and its software stack."
    )
    host_link_gbytes_per_s: float = bounded(
        26.0, GBYTES_PER_S, description="Bandwidth between the GPU and host memory, per direction, in GB/s (1e9 "
        "bytes/s), as activation offloading moves tensors: 0.8 of the link rate (PCIe Gen4 x16, 32 GB/s, by "
        "default; Gen5 x16 64 GB/s: 51; Grace's NVLink-C2C, 450 GB/s, limited by the LPDDR5X the Grace "
        "shares between its GPUs).")
    generation: Name | None = Field(
        None, description="The chip generation (volta, ampere, hopper, blackwell, cdna3, cpu): GPUs of one "
        "generation share kernels and efficiency, so a run measured on one of them validates the others "
        "(plan3d.cost.bands). None: the GPU's own name.")
    compute_efficiency: ComputeEfficiency = ComputeEfficiency()
    source: Text = ""

    @property
    def generation_name(self) -> str:
        """`generation`, or the GPU's name for a GPU that states none."""
        return self.generation or self.name

    @field_validator("peak_tflops")
    @classmethod
    def _every_precision_has_a_peak(cls, peaks: dict) -> dict:
        if not any(d in peaks for d in FALLBACK_DTYPES):
            raise ValueError(f"give the peak of at least one of {', '.join(FALLBACK_DTYPES)} (fp8 alone "
                             "leaves bf16/fp16/fp32 training without a peak), e.g. {bf16: 989}")
        return peaks

    @property
    def memory_bytes(self) -> float:
        return self.memory_gib * GIB

    @property
    def has_fp8(self) -> bool:
        """Whether the GPU has FP8 tensor cores: its spec states an fp8 peak (H100, H200, B200,
        GB200, MI300X; not A100, V100 or a CPU)."""
        return "fp8" in self.peak_tflops

    def require_precision(self, precision: str) -> None:
        """Raise a SpecError where the GPU cannot train in `precision` (fp8 without FP8 units):
        the one rule estimate, recommend and check all reach through the cost context."""
        if precision == "fp8" and not self.has_fp8:
            instead = next(d for d in FALLBACK_DTYPES if d in self.peak_tflops)
            raise SpecError(f"gpu {self.name}", [
                f"has no FP8 tensor cores (its spec states no fp8 peak), so it cannot train in fp8: use "
                f"--precision {instead} (or a GPU with fp8 in peak_tflops: H100, H200, B200, MI300X)"])

    def peak_flops(self, dtype: str) -> float:
        """Peak FLOP/s for `dtype`: a missing 16/32-bit dtype falls back to the next one stated;
        fp8 needs its own peak (`require_precision`)."""
        self.require_precision(dtype)
        if dtype in self.peak_tflops:
            return self.peak_tflops[dtype] * 1e12
        fallback = next(d for d in FALLBACK_DTYPES if d in self.peak_tflops)  # the validator saw one
        return self.peak_tflops[fallback] * 1e12
