"""Megatron-LM command-line arguments for a plan.

Flag names follow Megatron-LM's `megatron/training/arguments.py` (NVIDIA/Megatron-LM, core_r0.1x):
`--tensor-model-parallel-size`, `--pipeline-model-parallel-size`,
`--num-layers-per-virtual-pipeline-stage`, `--sequence-parallel`, `--context-parallel-size`,
`--micro-batch-size`, `--global-batch-size`, `--recompute-granularity {full,selective}`,
`--recompute-method {uniform,block}`, `--recompute-num-layers`, `--use-distributed-optimizer`
(ZeRO-1: optimizer states sharded over data parallel), `--bf16`/`--fp16`, `--fp8-format`,
`--decoder-first-pipeline-num-layers`/`--decoder-last-pipeline-num-layers` (uneven split), and
`--use-tp-pp-dp-mapping` (rank order tp-cp-ep-pp-dp instead of the default tp-cp-ep-dp-pp).

What Megatron-LM cannot express raises `InfeasibleError` (exit 1): ZeRO-2/3 (its distributed
optimizer shards optimizer states only), a rank order other than its two, an uneven split whose
middle stages differ, a plain ReLU MLP, ALiBi.
"""
from __future__ import annotations

from plan3d.emit.common import Emitted, same_groups
from plan3d.errors import InfeasibleError
from plan3d.layout import Layout
from plan3d.plan import Plan

MEGATRON_ORDERS = {"tp-cp-ep-dp-pp": (), "tp-cp-ep-pp-dp": ("--use-tp-pp-dp-mapping",)}


def megatron_args(plan: Plan) -> list[str]:
    """The Megatron-LM arguments (flag and value tokens) for the plan's layout, model and batch."""
    layout = plan.layout
    if layout.zero > 1:
        raise InfeasibleError(
            f"Megatron-LM cannot express ZeRO-{layout.zero}: its distributed optimizer shards optimizer "
            "states only (ZeRO-1); plan with --zero 0 or 1, or emit deepspeed/torchtitan instead")
    return (_parallel_args(layout) + _order_args(layout) + _pipeline_split_args(plan)
            + _batch_args(plan) + _recompute_args(layout) + _precision_args(plan) + _model_args(plan))


def _parallel_args(layout: Layout) -> list[str]:
    args = ["--tensor-model-parallel-size", str(layout.tp), "--pipeline-model-parallel-size", str(layout.pp)]
    if layout.cp > 1:
        args += ["--context-parallel-size", str(layout.cp)]
    if layout.ep > 1:
        args += ["--expert-model-parallel-size", str(layout.ep)]
    if layout.sequence_parallel:
        args.append("--sequence-parallel")
    if layout.zero == 1:
        args.append("--use-distributed-optimizer")
    return args


def _order_args(layout: Layout) -> list[str]:
    for order, flags in MEGATRON_ORDERS.items():
        if same_groups(layout, order):
            return list(flags)
    raise InfeasibleError(
        f"Megatron-LM cannot build rank order {layout.order!r} for this layout: it supports "
        f"{' and '.join(repr(o) for o in MEGATRON_ORDERS)} (--use-tp-pp-dp-mapping); re-plan with one of them")


def _pipeline_split_args(plan: Plan) -> list[str]:
    layout, layers = plan.layout, plan.model.layers
    split = layout.stage_layers(layers)
    args = []
    if layout.vpp > 1:
        if len(set(split)) != 1:
            raise InfeasibleError("Megatron-LM interleaving needs equal virtual stages; drop pp_layers or set vpp=1")
        args += ["--num-layers-per-virtual-pipeline-stage", str(split[0])]
    elif len(set(split)) > 1:
        args += _uneven_args(split)
    return args


def _uneven_args(split: tuple[int, ...]) -> list[str]:
    """Megatron-LM splits unevenly only at the ends: first and last stage sizes, the rest equal."""
    middle = split[1:-1]
    if len(set(middle)) > 1:
        raise InfeasibleError(f"Megatron-LM cannot split layers as {list(split)}: only the first and last "
                              "stage may differ; make the middle stages equal")
    return ["--decoder-first-pipeline-num-layers", str(split[0]),
            "--decoder-last-pipeline-num-layers", str(split[-1])]


def _batch_args(plan: Plan) -> list[str]:
    seq = plan.training.seq_len or plan.model.seq_len
    return ["--micro-batch-size", str(plan.layout.micro_batch),
            "--global-batch-size", str(plan.training.global_batch),
            "--seq-length", str(seq), "--max-position-embeddings", str(max(seq, plan.model.seq_len))]


def _recompute_args(layout: Layout) -> list[str]:
    if layout.recompute == "selective":
        return ["--recompute-granularity", "selective"]
    if layout.recompute == "full":
        return ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
    return []


def _precision_args(plan: Plan) -> list[str]:
    precision = plan.training.precision
    if precision == "fp8":
        return ["--bf16", "--fp8-format", "hybrid"]
    if precision in ("bf16", "fp16"):
        return [f"--{precision}"]
    return []


def _model_args(plan: Plan) -> list[str]:
    model = plan.model
    if model.activation == "relu":
        raise InfeasibleError("Megatron-LM GPT has no plain-ReLU MLP (gelu or --swiglu); change the model spec")
    if model.position == "alibi":
        raise InfeasibleError("Megatron-LM GPT has no ALiBi position embedding (learned_absolute or rope)")
    args = ["--num-layers", str(model.layers), "--hidden-size", str(model.hidden),
            "--num-attention-heads", str(model.heads), "--ffn-hidden-size", str(model.ffn_hidden_),
            "--vocab-size", str(model.vocab)]
    if model.head_dim is not None:
        args += ["--kv-channels", str(model.head_dim)]
    if model.kv_heads_ != model.heads:
        args += ["--group-query-attention", "--num-query-groups", str(model.kv_heads_)]
    if model.activation == "swiglu":
        args.append("--swiglu")
    if model.norm == "rmsnorm":
        args += ["--normalization", "RMSNorm"]
    if not model.bias:
        args.append("--disable-bias-linear")
        if model.qkv_bias_:
            args.append("--add-qkv-bias")  # Megatron-LM's flag for Qwen2-style Q/K/V biases
    args += ["--position-embedding-type", "learned_absolute" if model.position == "learned" else model.position]
    if not model.tied_embeddings:
        args.append("--untie-embeddings-and-output-weights")
    return args


def emit_megatron(plan: Plan) -> Emitted:
    """The arguments as a shell-ready block: one flag (and value) per line."""
    args = megatron_args(plan)
    lines, i = [], 0
    while i < len(args):
        takes_value = i + 1 < len(args) and not args[i + 1].startswith("--")
        lines.append(" ".join(args[i:i + 2]) if takes_value else args[i])
        i += 2 if takes_value else 1
    header = f"# Megatron-LM arguments for plan {plan.digest} ({plan.layout.short()}); world size {plan.layout.world_size}\n"
    return Emitted(header + " \\\n".join(lines) + "\n")
