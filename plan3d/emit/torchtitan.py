"""torchtitan TOML (`[parallelism]`, `[training]`, `[activation_checkpoint]`) for a plan.

Keys follow torchtitan's `torchtitan/config/job_config.py` (pytorch/torchtitan, 2025):
`parallelism.data_parallel_replicate_degree` / `data_parallel_shard_degree` (FSDP2 shards, DDP/HSDP
replicates), `fsdp_reshard_after_forward`, `tensor_parallel_degree`, `context_parallel_degree`,
`pipeline_parallel_degree`, `pipeline_parallel_schedule`, `pipeline_parallel_layers_per_stage`,
`pipeline_parallel_split_points`, `pipeline_parallel_microbatch_size`; `training.local_batch_size`
(per data-parallel rank), `training.global_batch_size` (gradient accumulation when larger),
`training.seq_len`, `training.mixed_precision_param`; `activation_checkpoint.mode`.

ZeRO maps onto FSDP2: ZeRO-3 is `data_parallel_shard_degree = dp` (reshard after forward),
ZeRO-2 is the same with `fsdp_reshard_after_forward = "never"` (parameters stay gathered between
forward and backward), ZeRO-0 is DDP (`data_parallel_replicate_degree = dp`, 1-D only).
torchtitan's device mesh is (pp, dp_replicate, dp_shard, cp, tp), slowest first: plan3d order
`tp-cp-dp-pp`. Not expressible (InfeasibleError, exit 1): ZeRO-1, DDP combined with tp/pp/cp,
fp16, another rank order.
"""
from __future__ import annotations

from itertools import accumulate

from plan3d.emit.common import Emitted, same_groups
from plan3d.errors import InfeasibleError
from plan3d.layout import Layout
from plan3d.plan import Plan

TORCHTITAN_ORDER = "tp-cp-ep-dp-pp"


def torchtitan_sections(plan: Plan) -> dict[str, dict]:
    """The TOML sections as nested mappings."""
    layout = plan.layout
    _check_expressible(plan)
    return {"parallelism": _parallelism(plan), "training": _training(plan),
            "activation_checkpoint": _activation_checkpoint(layout)}


def _check_expressible(plan: Plan) -> None:
    layout = plan.layout
    if layout.zero == 1:
        raise InfeasibleError("torchtitan has no ZeRO-1 (it shards with FSDP2: ZeRO-2/3, or replicates: "
                              "ZeRO-0); re-plan with --zero 2 or 3, or emit megatron/deepspeed")
    if layout.zero == 0 and (layout.tp > 1 or layout.pp > 1 or layout.cp > 1):
        raise InfeasibleError("torchtitan's DDP (ZeRO-0) does not compose with tp/pp/cp; re-plan with --zero 2 or 3")
    if plan.training.precision == "fp16":
        raise InfeasibleError("torchtitan trains in bf16 or fp32 (mixed_precision_param); choose --precision bf16")
    if not same_groups(layout, TORCHTITAN_ORDER):
        raise InfeasibleError(f"torchtitan's mesh is (pp, dp, cp, tp), i.e. order {TORCHTITAN_ORDER!r}; "
                              f"the plan has {layout.order!r}: re-plan with the default order")


def _parallelism(plan: Plan) -> dict:
    layout = plan.layout
    section = {
        "data_parallel_replicate_degree": layout.dp if layout.zero == 0 else 1,
        "data_parallel_shard_degree": layout.dp if layout.zero >= 2 else 1,
        "tensor_parallel_degree": layout.tp,
        "context_parallel_degree": layout.cp,
        "pipeline_parallel_degree": layout.pp,
    }
    if layout.zero == 2:
        section["fsdp_reshard_after_forward"] = "never"
    if layout.ep > 1:
        section["expert_parallel_degree"] = layout.ep
    if layout.pp > 1:
        section.update(_pipeline(plan, layout))
    return section


def _pipeline(plan: Plan, layout: Layout) -> dict:
    split = layout.stage_layers(plan.model.layers)
    out = {"pipeline_parallel_schedule": "Interleaved1F1B" if layout.vpp > 1 else "1F1B",
           "pipeline_parallel_microbatch_size": layout.micro_batch}
    if len(set(split)) == 1:
        out["pipeline_parallel_layers_per_stage"] = split[0]
    else:
        out["pipeline_parallel_split_points"] = [f"layers.{n}" for n in list(accumulate(split))[:-1]]
    return out


def _training(plan: Plan) -> dict:
    layout, training = plan.layout, plan.training
    per_replica = training.global_batch // layout.dp
    return {
        # With a pipeline the local batch is split into micro-batches; without one, torchtitan
        # accumulates gradients over global / (local * dp) steps.
        "local_batch_size": per_replica if layout.pp > 1 else layout.micro_batch,
        "global_batch_size": training.global_batch,
        "seq_len": training.seq_len or plan.model.seq_len,
        "mixed_precision_param": "float32" if training.precision == "fp32" else "bfloat16",
    }


def _activation_checkpoint(layout: Layout) -> dict:
    if layout.recompute == "selective":
        return {"mode": "selective", "selective_ac_option": "op"}
    return {"mode": layout.recompute}


def to_toml(sections: dict[str, dict]) -> str:
    """Minimal TOML writer for flat sections of ints, strings, bools and lists of strings."""
    out = []
    for name, values in sections.items():
        out.append(f"[{name}]")
        out += [f"{key} = {_toml_value(value)}" for key, value in values.items()]
        out.append("")
    return "\n".join(out)


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'


def emit_torchtitan(plan: Plan) -> Emitted:
    layout = plan.layout
    notes = []
    if layout.tp > 1 and not layout.sequence_parallel:
        notes.append("torchtitan's tensor parallel always shards norms along the sequence (sequence "
                     "parallel): activation memory will be lower than this plan predicts")
    if plan.training.precision == "fp8":
        notes.append("fp8: add the float8 converter ([model] converters = [\"float8\"], needs torchao)")
    header = f"# torchtitan sections for plan {plan.digest} ({layout.short()}); merge into your train config\n"
    return Emitted(header + to_toml(torchtitan_sections(plan)), notes)
