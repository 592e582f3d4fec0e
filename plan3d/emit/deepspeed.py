"""DeepSpeed `ds_config.json` for a plan, in the words of DeepSpeed 0.19 (checked against 0.19.8).

The engine profile is `deepspeed-0.19` (engine_specs/deepspeed-0.19.yaml); the `deepspeed` profile
describes DeepSpeed 0.3-0.5 of the 2021 published runs and is not what this emitter writes for.
Keys follow the configuration reference (deepspeed.ai/docs/config-json) and 0.19.8's own code:

- Batch: `DeepSpeedConfig._batch_assertion` (runtime/config.py) checks `train_batch_size ==
  micro * gradient_accumulation_steps * world_size`, where world_size is the mpu's data-parallel
  size when `deepspeed.initialize` has one (a PipelineModule brings its grid, whose data-parallel
  size is dp), else the whole world (`dist.get_world_size()`, runtime/config.py `__init__`).
  AutoTP training passes no mpu (deepspeed/__init__.py `initialize`), so the world is tp x dp and a
  train_batch_size of the plan's global batch fails; with tp > 1 the config leaves
  train_batch_size out and DeepSpeed derives it (`_set_batch_related_parameters`) for whichever
  world it sees. The tensor-parallel ranks see the same samples, so the distinct samples per step
  stay micro x accumulation x dp = the plan's global batch.
- Gradient accumulation dtype: `DeepSpeedEngine._do_optimizer_sanity_check` (runtime/engine.py)
  accepts bf16/fp16 parameters with fp32 accumulation only with ZeRO >= 1 (ZeRO-1 bf16 goes to
  BF16_Optimizer with fp32 accumulation buffers; ZeRO-2/3 keep fp32 gradient partitions); without
  ZeRO only equal dtypes pass ("unsupported mix of model_dtype=... and grad_accum_dtype=...").
- Overlap: `zero_optimization.overlap_comm` defaults to on for ZeRO-3 only (runtime/zero/config.py
  `overlap_comm_valid`); the time model assumes overlapped gradient reduction, so it is switched
  on for ZeRO 1-3 without a pipeline (a PipelineModule turns it off, runtime/engine.py
  `_configure_zero_optimizer`).
- AutoTP: `tensor_parallel.autotp_size` (AutoTP training), with ZeRO 0-3.

Settings that live in user code (the pipeline, activation checkpointing) come back as notes.
What DeepSpeed 0.19 cannot run raises `InfeasibleError` (exit 1): the profile's refusals
(`target_engine`) and AutoTP together with a pipeline: AutoTP builds a 2-D (data, tensor) mesh of
the whole world with dp = world // tp and no pipeline axis (utils/groups.py `_init_tp_mesh_device`),
which PipelineEngine's `assert self.dp_world_size == self.grid.data_parallel_size`
(runtime/pipe/engine.py) rejects; and fp8: DeepSpeed 0.19.8's config has no FP8 training
(`DeepSpeedConfig` reads the fp16, bf16 and torch_autocast precision sections, runtime/config.py
and runtime/precision_config.py, and refuses Apex "amp"; its ops/fp_quantizer FP8 GEMM is a
quantization kernel no config key turns on for training), so an fp8 plan would
silently train in bf16 at a slower step than predicted.

Mixture of experts (checked against 0.19.8): with ep = 1 no key is needed (the Hugging Face
model computes every expert on every rank; AutoTP splits the expert linears like the dense MLP,
module_inject/auto_tp.py, and leaves the router whole, as plan3d counts them). With ep > 1 the
config-only path is AutoEP, `"expert_parallel": {"enabled": true, "autoep_size": ep}`
(runtime/config.py `get_expert_parallel_config`, module_inject/auto_ep_config.py): at
`deepspeed.initialize` it replaces the MoE blocks of a Hugging Face model of a family with a preset
(auto_ep_presets: mixtral, qwen3_moe, qwen3_5_moe, deepseek_v2, deepseek_v3, minimax_m3) by
expert-parallel layers; its groups (utils/groups.py `_create_expert_and_data_parallel`, tp = 1):
ep groups of consecutive ranks inside each pipeline stage, expert data parallel strided by ep,
plan3d's "ep" and "edp" groups. Refused, naming the reason: ep > 1 with tp > 1 (AutoEP keeps
each expert whole, `expert_tensor_parallel_size` must be 1, auto_ep_folding.py
`validate_folding_global`, where plan3d splits experts over tp), and ep > 1 with a capacity factor
(AutoEP routes dropless: auto_ep_layer.py builds no capacity and drops nothing).
"""
from __future__ import annotations

from plan3d.render.units import json_text

from plan3d.emit.common import Emitted, target_engine
from plan3d.errors import InfeasibleError
from plan3d.plan import Plan

PROFILE = "deepspeed-0.19"
VERSIONS = "0.19"
HALF = {"bf16": "bf16", "fp16": "fp16"}  # DeepSpeed's model dtype per plan precision (fp8: refused)


def refuse_fp8(plan: Plan) -> None:
    """DeepSpeed 0.19's config trains in fp16, bf16 or fp32 only: an fp8 plan has no config."""
    if plan.training.precision == "fp8":
        raise InfeasibleError(f"DeepSpeed {VERSIONS} has no FP8 training in its config (its precision sections "
                              "are fp16, bf16 and torch_autocast): re-plan with --precision bf16, or emit "
                              "megatron or torchtitan for fp8")


def refuse_moe(plan: Plan) -> None:
    """What DeepSpeed 0.19 cannot run of a MoE plan with expert parallelism (AutoEP)."""
    moe, layout = plan.model.moe, plan.layout
    if layout.ep == 1:
        return
    if moe is None:
        raise InfeasibleError(f"DeepSpeed {VERSIONS}'s expert parallelism (AutoEP) replaces MoE layers; "
                              f"{plan.model.name} has none: set ep=1 or give the model spec a moe")
    if layout.tp > 1:
        raise InfeasibleError(f"DeepSpeed {VERSIONS}'s AutoEP keeps each expert whole (expert_parallel."
                              "expert_tensor_parallel_size must be 1) and plan3d splits experts over "
                              f"tp={layout.tp}: re-plan with tp=1, or emit megatron (expert tensor parallel = tp)")
    if moe.capacity_factor is not None:
        raise InfeasibleError(f"DeepSpeed {VERSIONS}'s AutoEP routes dropless (no capacity factor key); the model "
                              f"spec has capacity_factor={moe.capacity_factor:g}: drop it, or emit megatron")


def model_dtype(plan: Plan) -> str:
    """The parameter dtype DeepSpeed trains in: bf16, fp16, fp32."""
    return HALF.get(plan.training.precision, "fp32")


def grad_accum_dtype(plan: Plan) -> str:
    """fp32 where the plan keeps fp32 gradients (`Plan.grad_dtype`) and DeepSpeed can (ZeRO >= 1),
    else the model dtype."""
    if plan.grad_dtype == "fp32" and plan.layout.zero >= 1:
        return "fp32"
    return model_dtype(plan)


def ds_config(plan: Plan) -> dict:
    """The ds_config mapping: batch sizes, ZeRO stage and overlap, precision, accumulation dtype, AutoTP size."""
    layout = plan.layout
    config = {"train_micro_batch_size_per_gpu": layout.micro_batch,
              "gradient_accumulation_steps": layout.micro_batches(plan.training.global_batch)}
    if layout.tp == 1:
        config = {"train_batch_size": plan.training.global_batch, **config}
    zero = {"stage": layout.zero}
    if layout.zero >= 1 and layout.pp == 1:
        zero["overlap_comm"] = True
    config["zero_optimization"] = zero
    dtype = model_dtype(plan)
    config["bf16"] = {"enabled": dtype == "bf16"}
    config["fp16"] = {"enabled": dtype == "fp16"}
    config["data_types"] = {"grad_accum_dtype": grad_accum_dtype(plan)}
    if layout.tp > 1:
        config["tensor_parallel"] = {"autotp_size": layout.tp}
    if layout.ep > 1:
        config["expert_parallel"] = {"enabled": True, "autoep_size": layout.ep}
    return config


def _notes(plan: Plan) -> list[str]:
    layout, training = plan.layout, plan.training
    notes = []
    if layout.tp > 1:
        notes.append(f"train_batch_size is left to DeepSpeed: AutoTP's deepspeed.initialize checks it against the "
                     f"whole world (tp x dp = {layout.tp * layout.dp}), so it reports "
                     f"{plan.training.global_batch * layout.tp}; the tp ranks share samples, the step still "
                     f"trains on {plan.training.global_batch} (micro x accumulation x dp)")
    if plan.grad_dtype == "fp32" and model_dtype(plan) != "fp32" and layout.zero == 0:
        notes.append(f"DeepSpeed keeps {model_dtype(plan)} gradients without ZeRO (it refuses fp32 accumulation "
                     f"of {model_dtype(plan)} parameters at ZeRO-0): the plan budgets 4-byte fp32 gradients, "
                     "DeepSpeed uses 2 bytes per parameter and accumulates micro-batches in half precision; "
                     "use ZeRO-1 to keep fp32 accumulation")
    if layout.pp > 1:
        notes.append(f"build the model as deepspeed.pipe.PipelineModule(num_stages={layout.pp}, "
                     f"partition_method='uniform'); pipeline degree is not a config key; DeepSpeed's pipeline "
                     "reduces gradients after the schedule (no overlap_comm), the time model assumes it overlapped")
    elif layout.zero == 0 or (layout.zero == 1 and grad_accum_dtype(plan) == "fp32" and model_dtype(plan) == "bf16"):
        optimizer = "without ZeRO" if layout.zero == 0 else "at ZeRO-1 with bf16 and fp32 accumulation (BF16_Optimizer)"
        notes.append(f"DeepSpeed all-reduces gradients after the last backward {optimizer}; the time model "
                     "assumes the reduction overlapped with the backward: expect the step to take longer")
    notes += _moe_notes(plan)
    if layout.recompute != "none":
        notes.append(f"recompute={layout.recompute}: wrap layers with deepspeed.checkpointing.checkpoint "
                     "(or activation_checkpoint_interval=1 in PipelineModule); DeepSpeed has no config switch")
    return notes


def _moe_notes(plan: Plan) -> list[str]:
    moe, layout = plan.model.moe, plan.layout
    if moe is None:
        return []
    if layout.ep > 1:
        return [f"expert_parallel.autoep_size={layout.ep}: AutoEP finds the MoE blocks of a Hugging Face model of "
                "a preset family (mixtral, qwen3_moe, qwen3_5_moe, deepseek_v2, deepseek_v3, minimax_m3); for "
                "another model set expert_parallel's moe_layer_pattern, router_pattern and expert_pattern keys"]
    note = "ep=1: every rank computes all experts with the model's own MoE code (no expert_parallel key)"
    if moe.capacity_factor is not None:
        note += (f"; the model code decides token dropping, the plan's capacity_factor={moe.capacity_factor:g} "
                 "is not a DeepSpeed setting")
    return [note]


def emit_deepspeed(plan: Plan) -> Emitted:
    """The config as JSON, with the settings that live in user code as notes."""
    _, notes = target_engine(plan, PROFILE, VERSIONS)
    refuse_fp8(plan)
    refuse_moe(plan)
    text = json_text(ds_config(plan), indent=2) + "\n"
    return Emitted(text, notes + _notes(plan))
