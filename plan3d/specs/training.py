"""Training spec: batch, precision, optimizer, memory headroom."""
from __future__ import annotations

from typing import Literal

from pydantic import Field, PositiveInt

from plan3d.specs.base import MEMORY_GIB, SpecModel, Text, bounded


class TrainingSpec(SpecModel):
    global_batch: PositiveInt = Field(le=1_000_000_000, description="Sequences per optimizer step.")
    seq_len: PositiveInt | None = Field(None, le=1_000_000_000, description="Overrides the model's sequence length.")
    precision: Literal["bf16", "fp16", "fp8", "fp32"] = "bf16"
    optimizer: Literal["adam", "adamw", "sgd"] = "adam"
    fp32_grad_accum: bool = Field(True, description="Gradients kept in fp32 (Megatron-LM's default).")
    memory_headroom_fraction: float = Field(
        0.05, ge=0, lt=1, description="Fraction of device memory a layout must leave free to fit."
    )
    reserved_memory_gib: float | None = bounded(
        None, dict(MEMORY_GIB, ge=0), description="Overrides the GPU spec's reserved_memory_gib (memory no formula sees)."
    )
    source: Text = ""
