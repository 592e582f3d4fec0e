"""Megatron-Core arguments (`pretrain_gpt.py`) for a plan, for megatron-core 0.17 - 0.19.

The range is the releases whose wheel ships `megatron/training/arguments.py` (0.17.0 is the first;
earlier ones need a Megatron-LM checkout); every flag below exists in 0.17.0, 0.18.0 and 0.19.2,
and the engines tier (tests/engines/test_megatron_engine.py) feeds the output to 0.19.2's own
`parse_args` + `validate_args`. What the engine runs is the `megatron-core` engine profile's
`can_run` (`target_engine` refuses the rest); what its time model assumes (`runs_as`) is switched on:

- ZeRO-1: `--use-distributed-optimizer`. ZeRO-2/3: Megatron-FSDP, `--use-megatron-fsdp
  --data-parallel-sharding-strategy optim_grads | optim_grads_params` (validate_args turns the
  distributed optimizer on with it, asserts `--ckpt-format fsdp_dtensor` and that
  CUDA_DEVICE_MAX_CONNECTIONS is not 1). Without pipeline parallelism only: its device mesh
  (`megatron/core/distributed/fsdp/mcore_fsdp_adapter.py`, `_get_dp_tp_mesh`) lays all ranks out
  as dp x cp x ep x tp, so pp > 1 fails there (the profile's `zero_with_pp: [0, 1]`).
- `grad_reduce: overlapped` -> `--overlap-grad-reduce`; `param_gather_overlap` ->
  `--overlap-param-gather` (validate_args: needs the distributed optimizer or Megatron-FSDP and
  `--overlap-grad-reduce`, so ZeRO >= 1 only).
- `tp_overlap_fraction > 0` -> `--tp-comm-overlap` (Transformer Engine userbuffers), where
  validate_args allows it (sequence parallelism on) and the tensor-parallel group stays inside a
  node (userbuffers exchange over NVLink); otherwise a note says the prediction hides TP
  communication that this run will not hide.
- `attention: flash`: Megatron's default `--attention-backend auto` with its default
  Transformer Engine layers picks flash or cuDNN fused attention (neither writes scores to HBM)
  for bf16/fp16; fp32 falls back to unfused attention, which a note says.
- `export CUDA_DEVICE_MAX_CONNECTIONS=1` for tp > 1 or cp > 1 on GPUs before Blackwell
  (validate_args asserts it where `get_device_arch_version() < 10`); on Blackwell the requirement
  is gone and the variable is left alone; with Megatron-FSDP it is unset instead.
- Pipeline: `--num-virtual-stages-per-pipeline-rank` (interleaving, even split),
  `--decoder-first/last-pipeline-num-layers` (no interleaving, only the end stages differ) or
  `--pipeline-model-parallel-layout` (any other per-stage counts, with or without interleaving;
  its first stage holds the embedding `E`, its last the loss `L`); `--use-tp-pp-dp-mapping` for
  rank order tp-cp-ep-pp-dp.
- Model: every field of the spec that changes what Megatron builds (dropout, norm and epsilon,
  qk-norm, RoPE base and scaling, biases, vocabulary padding): plan3d/emit/megatron_model.py.
- Experts (`--num-experts`, ..., `--expert-model-parallel-size`, `--expert-tensor-parallel-size` = etp, by default tp)
  and multi-latent attention: plan3d/emit/megatron_moe.py, which also names what Megatron refuses
  for MoE layouts (ep not dividing the experts, tp > 1 without sequence parallelism, expert biases
  with tp > 1, the pp-dp order with pp > 1 and ep != cp).

What no Megatron-Core flag expresses is refused, naming the release range: a plain-ReLU MLP
(its activations are gelu, `--swiglu`, `--squared-relu`, `--quick-geglu`) and ALiBi
(`--position-embedding-type` choices) by the profile's `can_run.models`, read by `target_engine`
as by `recommend --engine`; here a rank order other than its two and a non-integer rope base
(`--rotary-base` is `type=int`).

The output is a job script (plan3d.emit.launch_script): run it on every node. Data, tokenizer and
schedule are not part of a plan: the caller passes them (`MegatronRun`: defaults in the script) or
the script requires them from the environment (`DATA_PATH`, `TOKENIZER`, `TRAIN_ITERS`, `LR`), as
it requires `MEGATRON_LM` (pretrain_gpt.py lives in a Megatron-LM checkout, not in the wheel).
Checkpoints go to (and resume from) `$RUN_DIR/checkpoints`, saved every `SAVE_INTERVAL`
iterations (default: at the end; Megatron asserts an interval with `--save`).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

from plan3d.emit.common import Emitted, read_as_engine, target_engine
from plan3d.emit.launch_script import JobScript, ScriptVariable, node_script
from plan3d.emit.megatron_model import model_args, vocab_notes
from plan3d.emit.megatron_moe import GROUPED_GEMM_MIN_ARCH, mla_args, mla_problems, moe_args, moe_notes, moe_problems
from plan3d.errors import InfeasibleError, SpecError
from plan3d.layout import Layout
from plan3d.plan import Plan
from plan3d.specs.engine import ACT_OFFLOAD_MODULES, EXPERT_OFFLOAD_MODULES, EngineSpec
from plan3d.vocab import recompute_modules

PROFILE = "megatron-core"
VERSIONS = "0.17-0.19"
ENGINE = f"{PROFILE} {VERSIONS}"
MEGATRON_ORDERS = {"tp-cp-ep-dp-pp": (), "tp-cp-ep-pp-dp": ("--use-tp-pp-dp-mapping",)}
FSDP_STRATEGY = {2: "optim_grads", 3: "optim_grads_params"}  # --data-parallel-sharding-strategy
# CUDA compute capability major by GPU spec name (the part before the first '-'): Megatron's
# get_device_arch_version(). Blackwell is 10; unknown GPUs are treated as before Blackwell.
ARCH_BY_GPU = {"v100": 7, "a100": 8, "a10": 8, "l40s": 8, "h100": 9, "h200": 9, "gh200": 9, "h800": 9,
               "b100": 10, "b200": 10, "gb200": 10, "b300": 10, "gb300": 10}
BLACKWELL = 10
MAX_TRAIN_ITERS = 10**12
MAX_LR = 10.0
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


@dataclass(frozen=True)
class MegatronRun:
    """What `pretrain_gpt.py` needs beyond the plan; None: named in the comment block instead.

    data_path: a Megatron dataset prefix, or "mock" (`--mock-data`, synthetic tokens);
    tokenizer: a Hugging Face tokenizer name or path (`HuggingFaceTokenizer`), or "null"
    (`NullTokenizer`, the model's vocabulary, for mock data)."""

    data_path: str | None = None
    tokenizer: str | None = None
    train_iters: int | None = None
    lr: float | None = None

    def problems(self) -> list[str]:
        """Each flag that cannot go into the block, with what to give instead."""
        out = []
        if self.train_iters is not None and not 1 <= self.train_iters <= MAX_TRAIN_ITERS:
            out.append(f"--train-iters must be a positive integer (at most {MAX_TRAIN_ITERS:.0e}), got {self.train_iters}")
        if self.lr is not None and not (math.isfinite(self.lr) and 0 < self.lr <= MAX_LR):
            out.append(f"--lr must be a learning rate in (0, {MAX_LR}], got {self.lr}")
        for flag, text in (("--data-path", self.data_path), ("--tokenizer", self.tokenizer)):
            if text is not None and (not text.strip() or _CONTROL.search(text) or text.startswith("-")):
                out.append(f"{flag} must be a path or name on one line, not starting with '-', got {text!r}")
        return out


def check_megatron_run(run: MegatronRun) -> None:
    """Bad run flags are a one-line error each (SpecError), before anything is written."""
    problems = run.problems()
    if problems:
        raise SpecError("command line", problems)


def megatron_args(plan: Plan, engine: EngineSpec | None = None) -> list[str]:
    """The Megatron-Core arguments (flag and value tokens) for the plan's layout, model and batch."""
    plan = _with_megatron_order(read_as_engine(plan, PROFILE)[0])
    if engine is None:
        engine, _ = target_engine(plan, PROFILE, VERSIONS)
    layout = plan.layout
    return (_parallel_args(layout) + _cp_comm_args(layout, engine) + _order_args(layout) + _pipeline_split_args(plan) + _zero_args(layout)
            + _overlap_args(plan, engine) + _batch_args(plan) + _recompute_args(plan) + _offload_args(plan, engine)
            + _precision_args(plan) + _model_args(plan, engine))


def _with_megatron_order(plan: Plan) -> Plan:
    """The plan with its order spelled as the Megatron order that builds the same groups (axes of
    size one do not change the groups); an order that matches neither is refused."""
    for order in MEGATRON_ORDERS:
        if plan.layout.same_groups_as(order):
            return plan.model_copy(update={"layout": plan.layout.model_copy(update={"order": order})})
    return plan  # target_engine refuses it with the profile's sentence


def _parallel_args(layout: Layout) -> list[str]:
    args = ["--tensor-model-parallel-size", str(layout.tp), "--pipeline-model-parallel-size", str(layout.pp)]
    if layout.cp > 1:
        args += ["--context-parallel-size", str(layout.cp)]
    if layout.ep > 1:
        args += ["--expert-model-parallel-size", str(layout.ep)]
    if layout.sequence_parallel:
        args.append("--sequence-parallel")
    return args


def _cp_comm_args(layout: Layout, engine: EngineSpec) -> list[str]:
    """--cp-comm-type, the K/V exchange the plan was predicted with (TransformerConfig.cp_comm_type:
    p2p, all_gather, a2a); written with cp > 1 only."""
    return ["--cp-comm-type", engine.runs_as.cp_comm] if layout.cp > 1 else []


def _order_args(layout: Layout) -> list[str]:
    """megatron/training/initialize.py builds ranks as tp-cp-ep-dp-pp, or tp-cp-ep-pp-dp with the flag."""
    if layout.order not in MEGATRON_ORDERS:
        raise InfeasibleError(f"{ENGINE} cannot build rank order {layout.order!r} for this layout: it supports "
                              f"{' and '.join(repr(o) for o in MEGATRON_ORDERS)} (--use-tp-pp-dp-mapping)")
    return list(MEGATRON_ORDERS[layout.order])


def _zero_args(layout: Layout) -> list[str]:
    if layout.zero == 1:
        return ["--use-distributed-optimizer"]
    if layout.zero in FSDP_STRATEGY:
        return ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", FSDP_STRATEGY[layout.zero],
                "--use-distributed-optimizer", "--ckpt-format", "fsdp_dtensor"]
    return []


def _overlap_args(plan: Plan, engine: EngineSpec) -> list[str]:
    runs_as, layout, args = engine.runs_as, plan.layout, []
    if runs_as.grad_reduce == "overlapped":
        args.append("--overlap-grad-reduce")
        if runs_as.param_gather_overlap and layout.zero >= 1:
            args.append("--overlap-param-gather")
    if _tp_comm_overlap(plan, engine):
        args.append("--tp-comm-overlap")
    return args


def _tp_comm_overlap(plan: Plan, engine: EngineSpec) -> bool:
    layout = plan.layout
    return (engine.runs_as.tp_overlap_fraction > 0 and layout.tp > 1 and layout.sequence_parallel
            and layout.tp <= plan.cluster.gpus_per_node and not _tp_overlap_conflict(plan, engine))


def _tp_overlap_conflict(plan: Plan, engine: EngineSpec) -> bool:
    """The profile's rule that the TP overlap cannot run next to this ZeRO stage on this GPU."""
    conflict = engine.runs_as.tp_overlap_conflict
    return bool(conflict is not None and conflict.drops_tp_overlap(plan.layout.zero, plan.cluster.gpu.generation_name))


def _pipeline_split_args(plan: Plan) -> list[str]:
    layout = plan.layout
    split = layout.stage_layers(plan.model.layers)
    if len(set(split)) > 1 and layout.vpp == 1 and len(set(split[1:-1])) <= 1:
        return ["--decoder-first-pipeline-num-layers", str(split[0]),
                "--decoder-last-pipeline-num-layers", str(split[-1])]  # only the end stages differ
    if len(set(split)) > 1:
        return ["--pipeline-model-parallel-layout", pipeline_layout(split)]
    if layout.vpp > 1:
        return ["--num-virtual-stages-per-pipeline-rank", str(layout.vpp)]
    return []


def pipeline_layout(split: tuple[int, ...]) -> str:
    """Megatron's `--pipeline-model-parallel-layout` for layers per (virtual) stage, in stage order:
    `E` (embedding) opens the first stage, `L` (loss) closes the last, `t*n` is n decoder layers,
    `|` separates stages (megatron/core/transformer/pipeline_parallel_layer_layout.py)."""
    stages = [f"t*{n}" for n in split]
    stages[0] = "E" + stages[0]
    stages[-1] += "L"
    return "|".join(stages)


def _batch_args(plan: Plan) -> list[str]:
    seq = plan.training.seq_len or plan.model.seq_len
    return ["--micro-batch-size", str(plan.layout.micro_batch),
            "--global-batch-size", str(plan.training.global_batch),
            "--seq-length", str(seq), "--max-position-embeddings", str(max(seq, plan.model.seq_len))]


def _recompute_args(plan: Plan) -> list[str]:
    layout = plan.layout
    if layout.recompute == "partial":  # TransformerBlock: the first N layers of each (virtual) chunk checkpointed
        return ["--recompute-granularity", "full", "--recompute-method", "block",
                "--recompute-num-layers", str(partial_recompute_layers(plan))]
    if layout.recompute == "selective":
        return ["--recompute-granularity", "selective"]
    # moe-act: output-discarding checkpoints (core_attn left out: flash attention saves nothing to
    # drop); moe: the MoE layer under one checkpoint (MoELayer.moe_layer_recompute) and the norm;
    # mla-up: DeepSeek-V3's, the up-projections, the norms, the experts' activation (RECOMPUTE_MODULES)
    modules = recompute_modules(layout.recompute, plan.model.moe is not None)
    if modules:
        return ["--recompute-granularity", "selective", "--recompute-modules", *modules]
    if layout.recompute == "full":
        return ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
    return []


def _offload_args(plan: Plan, engine: EngineSpec) -> list[str]:
    """Fine-grained activation offloading of the modules the plan was priced with (ACT_OFFLOAD_MODULES;
    the expert modules only for an MoE model)."""
    modules = [m for m in ACT_OFFLOAD_MODULES[engine.runs_as.act_offload]
               if plan.model.moe is not None or m not in EXPERT_OFFLOAD_MODULES]
    return ["--fine-grained-activation-offloading", "--offload-modules", *modules] if modules else []


def partial_recompute_layers(plan: Plan) -> int:
    """N of partial recompute: the plan's estimate chose it (the fewest layers per virtual chunk that
    make the most-loaded rank fit, plan3d.cost.memory.partial_recompute_layers)."""
    if plan.estimate is None:
        raise InfeasibleError("recompute partial needs the number of layers to recompute, which the plan's estimate "
                              "chooses: make the plan with `plan3d recommend --out`, which estimates it")
    layers = plan.estimate.recompute_layers
    if layers < 1:
        raise InfeasibleError(f"recompute partial: {plan.layout.short()} fits without recomputing any layer; "
                              "use recompute none")
    return layers


def _precision_args(plan: Plan) -> list[str]:
    precision = plan.training.precision
    plan.cluster.gpu.require_precision(precision)  # fp8 needs FP8 units (Transformer Engine: sm_89+)
    if precision == "fp8":  # TransformerConfig.fp8 / fp8_recipe (megatron-core 0.19): TE's hybrid E4M3/E5M2
        return ["--bf16", "--fp8-format", "hybrid", "--fp8-recipe", fp8_recipe(plan)] + _grad_dtype_args(plan)
    if precision in ("bf16", "fp16"):
        return [f"--{precision}"] + _grad_dtype_args(plan)
    return []


DELAYED_SCALING_REFUSES = ("moe_act", "layernorm")  # recompute modules delayed FP8 scaling refuses


def fp8_recipe(plan: Plan) -> str:
    """Delayed scaling, except with moe-act / moe / mla-up recompute: TransformerConfig refuses moe_act and
    layernorm recompute under delayed scaling ("Delayed scaling does not support moe_act and
    layernorm recompute for fp8") and takes them with per-tensor current scaling (tensorwise) on
    Transformer Engine >= 2.6."""
    modules = recompute_modules(plan.layout.recompute, plan.model.moe is not None)
    return "tensorwise" if set(modules) & set(DELAYED_SCALING_REFUSES) else "delayed"


def _grad_dtype_args(plan: Plan) -> list[str]:
    """The gradient buffer the plan budgets (`Plan.grad_dtype`), where it is not Megatron's default
    (validate_args, megatron-core 0.19: bf16 turns --accumulate-allreduce-grads-in-fp32 on unless
    --grad-reduce-in-bf16; fp16 keeps fp16 gradients without the flag)."""
    dtype, precision = plan.grad_dtype, plan.training.precision
    if precision in ("bf16", "fp8") and dtype == "bf16":  # fp8 trains with bf16 master gradients
        return ["--grad-reduce-in-bf16"]
    if precision == "fp16" and dtype == "fp32":
        return ["--accumulate-allreduce-grads-in-fp32"]
    return []


def _model_args(plan: Plan, engine: EngineSpec) -> list[str]:
    """The model as its spec defines it (plan3d.emit.megatron_model), then experts (moving and
    hiding tokens as `engine` runs them) and MLA."""
    return model_args(plan) + _moe_mla_args(plan, engine.runs_as.ep_dispatcher,
                                            engine.runs_as.combined_1f1b)


def _moe_mla_args(plan: Plan, dispatcher: str, combined: bool) -> list[str]:
    """Experts and multi-latent attention (plan3d.emit.megatron_moe), after refusing what Megatron refuses."""
    problems = moe_problems(plan) + mla_problems(plan.model)
    moe_act = plan.layout.recompute == "moe-act" or (plan.layout.recompute == "mla-up" and plan.model.moe is not None)
    if moe_act and gpu_arch(plan) < GROUPED_GEMM_MIN_ARCH:
        problems.append(f"recompute {plan.layout.recompute} needs --moe-grouped-gemm (TransformerConfig: 'moe_act in recompute_modules "
                        "is only supported with moe_grouped_gemm'), which needs compute capability >= 8; "
                        "use selective or full recompute")
    if problems:
        raise InfeasibleError(f"{ENGINE} cannot run {plan.layout.short()} of {plan.model.name}: " + "; ".join(problems))
    return moe_args(plan, gpu_arch(plan), dispatcher, combined) + mla_args(plan.model)


MEGATRON_LM_VAR = ScriptVariable(
    "MEGATRON_LM", f"set MEGATRON_LM to a Megatron-LM checkout of a {VERSIONS} release (pretrain_gpt.py is not "
    "in the megatron-core wheel)")
RUN_LINES = [  # what `run` gives, appended to ARGS at run time (DATA_PATH=mock, TOKENIZER=null: synthetic)
    'case "$DATA_PATH" in',
    "  mock) ARGS+=(--mock-data) ;;",
    '  *) ARGS+=(--data-path "$DATA_PATH" --split "99,1,0" --data-cache-path "$RUN_DIR/data-cache") ;;',
    "esac",
    'case "$TOKENIZER" in',
    "  null) ARGS+=(--tokenizer-type NullTokenizer) ;;",
    '  *) ARGS+=(--tokenizer-type HuggingFaceTokenizer --tokenizer-model "$TOKENIZER") ;;',
    "esac",
    'ARGS+=(--train-iters "$TRAIN_ITERS" --lr "$LR")',
    '# checkpoints: --load resumes from the last one (none yet: starts from scratch); saved every SAVE_INTERVAL',
    'ARGS+=(--save "$RUN_DIR/checkpoints" --load "$RUN_DIR/checkpoints" --save-interval "$SAVE_INTERVAL")',
    'ARGS+=(--tensorboard-dir "$RUN_DIR/tensorboard")',
]


def run_variables(run: MegatronRun, model_vocab: int) -> list[ScriptVariable]:
    """The script's settings that are not in the plan: given to emit (defaults) or required."""
    return [
        MEGATRON_LM_VAR,
        ScriptVariable("DATA_PATH", "set DATA_PATH to a Megatron dataset prefix (.bin/.idx), or mock for "
                       "synthetic tokens", run.data_path),
        ScriptVariable("TOKENIZER", "set TOKENIZER to a Hugging Face tokenizer name or path, or null for the "
                       f"vocabulary of the model, {model_vocab} tokens (with DATA_PATH=mock)", run.tokenizer),
        ScriptVariable("TRAIN_ITERS", "set TRAIN_ITERS to the number of training iterations",
                       None if run.train_iters is None else str(run.train_iters)),
        ScriptVariable("LR", "set LR to the peak learning rate", None if run.lr is None else repr(float(run.lr))),
        ScriptVariable("SAVE_INTERVAL", "", "$TRAIN_ITERS", expand=True),
    ]


OFFLOAD_ENV = ("export NVTE_CPU_OFFLOAD_V1=1  # activation offloading: validate_args asserts it with Transformer "
               "Engine >= 2.10 (weights stay on the GPU)")


def environment_lines(plan: Plan, engine: EngineSpec | None = None) -> list[str]:
    """Shell lines that set what validate_args checks in the environment."""
    offload = [OFFLOAD_ENV] if engine is not None and ACT_OFFLOAD_MODULES[engine.runs_as.act_offload] else []
    return offload + _connection_lines(plan)


def _connection_lines(plan: Plan) -> list[str]:
    layout = plan.layout
    if layout.zero in FSDP_STRATEGY:
        return ["unset CUDA_DEVICE_MAX_CONNECTIONS  # Megatron-FSDP asserts it is not 1"]
    if layout.tp == 1 and layout.cp == 1:
        return []
    if gpu_arch(plan) >= BLACKWELL:
        return [f"# {plan.cluster.gpu.name} is Blackwell: Megatron-Core no longer needs CUDA_DEVICE_MAX_CONNECTIONS=1"]
    return ["export CUDA_DEVICE_MAX_CONNECTIONS=1  # tp > 1 or cp > 1 before Blackwell: validate_args asserts it"]


def gpu_arch(plan: Plan) -> int:
    """The CUDA compute capability major of the plan's GPU, by its spec name (0 when unknown)."""
    return ARCH_BY_GPU.get(plan.cluster.gpu.name.lower().split("-")[0], 0)


def plan_notes(plan: Plan, engine: EngineSpec) -> list[str]:
    """What the time model assumes of Megatron-Core that these arguments cannot give this plan."""
    layout, notes = plan.layout, []
    if _tp_overlap_conflict(plan, engine) and layout.tp > 1:
        notes.append(f"--tp-comm-overlap is off: {engine.runs_as.tp_overlap_conflict.why}; the prediction "
                     "hides none of the tensor-parallel communication")
    elif engine.runs_as.tp_overlap_fraction > 0 and layout.tp > 1 and not _tp_comm_overlap(plan, engine):
        why = ("it needs sequence parallelism (validate_args)" if not layout.sequence_parallel
               else "its tensor-parallel group spans nodes (Transformer Engine userbuffers are intra-node)")
        notes.append(f"the prediction hides {engine.runs_as.tp_overlap_fraction:.0%} of the tensor-parallel "
                     f"communication, but --tp-comm-overlap is off: {why}; expect a slower step")
    notes += moe_notes(plan, gpu_arch(plan)) + vocab_notes(plan)
    if plan.training.precision == "fp8" and fp8_recipe(plan) == "tensorwise":
        notes.append(f"fp8 with {plan.layout.recompute} recompute: --fp8-recipe tensorwise (per-tensor current scaling; "
                     "Megatron-Core refuses moe_act/layernorm recompute under delayed scaling), which needs Transformer "
                     "Engine >= 2.6; the prediction does not tell the FP8 recipes apart")
    if engine.runs_as.attention == "flash" and plan.training.precision == "fp32":
        notes.append("the prediction assumes flash attention; Transformer Engine's flash and fused attention "
                     "need bf16/fp16, so fp32 runs unfused attention (slower, more memory)")
    return notes


def megatron_job(plan: Plan, run: MegatronRun | None = None) -> tuple[JobScript, list[str]]:
    """The job script's Megatron parts for `plan`, and the notes for the user."""
    plan, read_notes = read_as_engine(plan, PROFILE)
    plan = _with_megatron_order(plan)
    engine, notes = target_engine(plan, PROFILE, VERSIONS)
    notes = read_notes + notes
    job = JobScript(engine=ENGINE, program=['"$MEGATRON_LM/pretrain_gpt.py"'], args=megatron_args(plan, engine),
                    variables=run_variables(run or MegatronRun(), plan.model.vocab),
                    environment=environment_lines(plan, engine), run_lines=RUN_LINES)
    return job, notes + plan_notes(plan, engine)


def emit_megatron(plan: Plan, run: MegatronRun | None = None) -> Emitted:
    """A bash script to run on every node: `torchrun ... pretrain_gpt.py` with the plan's arguments
    (plan3d.emit.launch_script), the run settings `run` gives baked in as defaults and the rest
    required from the environment."""
    job, notes = megatron_job(plan, run)
    return Emitted(node_script(plan, job), notes)
