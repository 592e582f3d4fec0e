"""Training spec: batch, precision, optimizer, memory headroom."""
from __future__ import annotations

from typing import Literal

from pydantic import Field, PositiveInt

from plan3d.specs.base import MEMORY_GIB, SpecModel, Text, bounded


class TrainingSpec(SpecModel):
    global_batch: PositiveInt = Field(le=1_000_000_000, description="Sequences per optimizer step.")
    seq_len: PositiveInt | None = Field(None, le=1_000_000_000, description="Overrides the model's sequence length.")
    precision: Literal["bf16", "fp16", "fp8", "fp32"] = Field(
        "bf16", description="Compute precision. fp8: the linear layers' GEMMs in FP8 (Transformer Engine hybrid "
        "E4M3/E5M2, torchao float8) with bf16 attention, norms, embedding, output layer and master weights; "
        "needs a GPU with an fp8 peak (H100, H200, B200, MI300X; refused on A100, V100, CPUs).")
    optimizer: Literal["adam", "adamw", "sgd"] = "adam"
    fp32_grad_accum: bool | None = Field(None, description="Gradients accumulated (and reduced) in fp32 (true) or in "
                                         "the 16-bit training dtype (false); empty: as the engine does "
                                         "(engine runs_as.gradients: Megatron, torchtitan and DeepSpeed bf16 keep "
                                         "fp32, fp16 keeps fp16).")
    memory_headroom_fraction: float = Field(
        0.05, ge=0, lt=1, description="Fraction of device memory a layout must leave free to fit."
    )
    reserved_memory_gib: float | None = bounded(
        None, dict(MEMORY_GIB, ge=0), description="Overrides the GPU spec's reserved_memory_gib (memory no formula sees)."
    )
    source: Text = ""


CPU_GENERATION = "cpu"  # GPUSpec.generation of a CPU process standing in for a GPU (cpu-process.yaml)


def default_precision(gpu) -> str:
    """The precision a plan assumes when none is given: fp32 where the "GPU" is a CPU process
    (plan3d's runtime trains fp32 on CPU: runtime/train.py `run_precision`), bf16 elsewhere. The
    one place this default is decided (recommend, explain, estimate, launch)."""
    return "fp32" if gpu.generation_name == CPU_GENERATION else "bf16"


def with_precision(training: TrainingSpec, gpu, given: str | None) -> TrainingSpec:
    """`training` as built from the command line: its precision as given (validated there), or,
    with none given, `default_precision(gpu)`."""
    return training if given is not None else training.model_copy(update={"precision": default_precision(gpu)})
