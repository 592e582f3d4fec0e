"""FP8 training in the time model: which GEMMs run in FP8, at what rate, and the cast traffic.

What `--precision fp8` means here is what Transformer Engine (Megatron-Core `--fp8-format hybrid
--fp8-recipe delayed`) and torchao float8 (torchtitan's Float8LinearConverter) run: the linear
layers' GEMMs (fused QKV, attention output projection, FC1 with its gate, FC2) in FP8, forward,
data-gradient and weight-gradient alike (Megatron-Core TransformerConfig.fp8_wgrad defaults to
True); the attention core (Q K^T, scores x V), norms, the embedding and the output layer stay in
bf16, as do the master weights, gradients and optimizer. Each FP8 GEMM input is cast first:
with delayed scaling TE's cast-transpose reads the bf16 tensor once and writes it in FP8 twice
(the tensor and the transpose the other pass needs), the amax folded into the same kernel:
`CAST_BYTES` = 2 + 1 + 1 bytes per element cast.
"""
from __future__ import annotations

from plan3d.specs.gpu import ComputeEfficiency, GPUSpec
from plan3d.specs.training import TrainingSpec

CAST_BYTES = 4.0  # bf16 read + fp8 write + fp8 transpose write, per element cast
BF16 = "bf16"


def compute_dtype(precision: str) -> str:
    """The dtype whose peak every GEMM but the fp8 ones runs at: bf16 under fp8 training."""
    return BF16 if precision == "fp8" else precision


def fp8_fields(gpu: GPUSpec, eff: ComputeEfficiency, max_fraction: float, training: TrainingSpec) -> dict:
    """The CostContext fields of fp8 training (all zero for 16/32-bit precisions): the fp8 peak,
    the fp8 GEMM ceiling (`fp8_gemm_fraction` of the bf16 one, `max_fraction`), the cast bytes.
    Raises SpecError where the GPU has no FP8 units (GPUSpec.require_precision)."""
    gpu.require_precision(training.precision)
    if training.precision != "fp8":
        return {}
    return dict(fp8_peak_flops=gpu.peak_flops("fp8"), fp8_max_fraction=max_fraction * eff.fp8_gemm_fraction,
                fp8_cast_bytes=CAST_BYTES)
