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
    """Achieved fraction of dense peak for the GEMMs of one transformer layer.

    eff(work) = max_fraction * work / (work + half_work_flops), where `work` is the FLOPs of one
    per-GPU GEMM (shrinks with larger tp and smaller micro-batch * sequence). A saturating curve:
    large GEMMs approach `max_fraction`, small ones fall off. Values are fitted by
    `plan3d calibrate` or `benchmarks/accuracy.py`, not hand-set.
    """

    max_fraction: float = Field(0.75, gt=0, le=1)
    half_work_flops: float = Field(2.0e9, ge=0)


class GPUSpec(StrictModel):
    name: str
    memory_gib: PositiveFloat = Field(description="Device memory in GiB (2^30 bytes).")
    peak_tflops: dict[Dtype, PositiveFloat] = Field(
        description="Dense (no sparsity) peak tensor throughput per dtype, in TFLOP/s (1e12)."
    )
    hbm_tbytes_per_s: PositiveFloat = Field(description="HBM bandwidth in TB/s (1e12 bytes/s).")
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
