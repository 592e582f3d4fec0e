"""DeepSpeed `ds_config.json` for a plan.

Keys follow the DeepSpeed configuration reference (deepspeed.ai/docs/config-json):
`train_batch_size` = `train_micro_batch_size_per_gpu` * `gradient_accumulation_steps` * data-parallel
size, `zero_optimization.stage`, `bf16.enabled` / `fp16.enabled`, and `tensor_parallel.autotp_size`
(AutoTP training, DeepSpeed >= 0.16.4). Pipeline parallelism in DeepSpeed is a `PipelineModule`
(`num_stages`) built in user code, not a config key; its topology (`PipeDataParallelTopology`,
axes pipe then data, data fastest) matches plan3d's default order. Settings that live in user
code (the pipeline degree, activation checkpointing) come back as notes, never as config keys.

What DeepSpeed cannot express raises `InfeasibleError` (exit 1): pipeline parallelism with ZeRO-2/3
(`PipelineEngine` supports ZeRO-0/1 only), AutoTP together with ZeRO-3 or with a pipeline,
context parallelism, sequence parallelism, virtual pipeline stages, or a rank order its
topologies cannot build.
"""
from __future__ import annotations

from plan3d.render.units import json_text

from plan3d.emit.common import Emitted, same_groups
from plan3d.errors import InfeasibleError
from plan3d.layout import Layout
from plan3d.plan import Plan

DEEPSPEED_ORDER = "tp-cp-ep-dp-pp"  # AutoTP: adjacent ranks; PipeDataParallelTopology: data fastest


def ds_config(plan: Plan) -> dict:
    """The ds_config mapping: batch sizes, ZeRO stage, precision, AutoTP size."""
    layout = plan.layout
    _check_expressible(layout)
    steps = layout.micro_batches(plan.training.global_batch)
    config = {
        "train_batch_size": plan.training.global_batch,
        "train_micro_batch_size_per_gpu": layout.micro_batch,
        "gradient_accumulation_steps": steps,
        "zero_optimization": {"stage": layout.zero},
        "bf16": {"enabled": plan.training.precision in ("bf16", "fp8")},
        "fp16": {"enabled": plan.training.precision == "fp16"},
    }
    if layout.tp > 1:
        config["tensor_parallel"] = {"autotp_size": layout.tp}
    if plan.training.fp32_grad_accum and plan.training.precision in ("bf16", "fp8"):
        config["data_types"] = {"grad_accum_dtype": "fp32"}
    return config


def _check_expressible(layout: Layout) -> None:
    if layout.pp > 1 and layout.zero > 1:
        raise InfeasibleError(f"DeepSpeed's pipeline engine supports ZeRO-0/1 only, the plan has pp={layout.pp} "
                              f"with ZeRO-{layout.zero}; use --zero 1 or emit megatron/torchtitan")
    if layout.tp > 1 and (layout.pp > 1 or layout.zero == 3):
        raise InfeasibleError("DeepSpeed AutoTP does not combine with a pipeline or ZeRO-3; "
                              "use Megatron-DeepSpeed (emit megatron) or torchtitan")
    if layout.cp > 1 or layout.vpp > 1 or layout.sequence_parallel:
        raise InfeasibleError("DeepSpeed's config has no context parallelism, Megatron-style sequence "
                              "parallelism or interleaved pipeline; set cp=1, vpp=1, no sequence_parallel, "
                              "or emit megatron")
    if not same_groups(layout, DEEPSPEED_ORDER):
        raise InfeasibleError(f"DeepSpeed builds rank order {DEEPSPEED_ORDER!r} only (tp adjacent, data "
                              f"before pipe); the plan has {layout.order!r}: re-plan with the default order")


def emit_deepspeed(plan: Plan) -> Emitted:
    """The config as JSON, with the settings that live in user code as notes."""
    layout = plan.layout
    text = json_text(ds_config(plan), indent=2) + "\n"
    notes = []
    if layout.pp > 1:
        notes.append(f"build the model as deepspeed.pipe.PipelineModule(num_stages={layout.pp}, "
                     f"partition_method='uniform'); pipeline degree is not a config key")
    if layout.recompute != "none":
        notes.append(f"recompute={layout.recompute}: wrap layers with deepspeed.checkpointing.checkpoint "
                     "(or activation_checkpoint_interval=1 in PipelineModule); DeepSpeed has no config switch")
    return Emitted(text, notes)
