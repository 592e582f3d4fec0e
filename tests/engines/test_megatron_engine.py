"""Megatron-Core's own code on every plan of the matrix: `plan3d emit megatron` fed to
`megatron.training.arguments.parse_args` + `validate_args` (megatron-core 0.19.2, the wheel's
`megatron/training`), its `TransformerConfig` (which checks the pipeline layout and recompute
settings) and its rank generator (`megatron.core.parallel_state.RankGenerator`).

Each case ends in one of two ways: the emitted block is accepted with the plan's values (tp, pp,
vpp, dp, cp, micro and global batch, ZeRO, recompute, sequence parallelism, sequence length,
model shape, layers per stage, rank groups), or plan3d refuses it and Megatron's own code fails
on the arguments the plan would need (REFUSALS names the confirming code). World size and rank
are set as torchrun sets them; `get_device_arch_version` (it reads the CUDA device) is patched to
the plan's GPU generation, as the emitter reads it from the GPU spec name.
"""
from __future__ import annotations

import contextlib
import io
import os
import sys
from unittest import mock

import pytest

from conftest import require
from script_helpers import REQUIRED_DEFAULTS, SENTINEL, run_script
from plans import CASES, Case, build, case_ids
from plan3d.emit.megatron import FSDP_STRATEGY, MegatronRun, emit_megatron, gpu_arch
from plan3d.errors import InfeasibleError
from plan3d.layout import Layout
from plan3d.plan import Plan, build_plan
from plan3d.specs.catalog import load_cluster, load_engine, load_model
from plan3d.specs.model import MoESpec
from plan3d.specs.training import TrainingSpec

RUN = MegatronRun(data_path="mock", tokenizer="null", train_iters=10, lr=3e-4)
MEGATRON_ORDER = {False: "tp-cp-ep-dp-pp", True: "tp-cp-ep-pp-dp"}  # megatron/training/initialize.py


@pytest.fixture(scope="module")
def megatron():
    return require("megatron.training.arguments")


def shell_parts(text: str) -> tuple[dict[str, str], list[str], list[str]]:
    """(what the job script exports of CUDA_DEVICE_MAX_CONNECTIONS, what it unsets of it, the
    arguments pretrain_gpt.py gets), from running it with a stub torchrun."""
    run = run_script(text)
    assert run.returncode == 0, run.stderr
    value = run.env.get("CUDA_DEVICE_MAX_CONNECTIONS")
    env = {} if value in (None, SENTINEL) else {"CUDA_DEVICE_MAX_CONNECTIONS": value}
    if run.env.get("NVTE_CPU_OFFLOAD_V1") not in (None, SENTINEL):  # activation offloading (validate_args)
        env["NVTE_CPU_OFFLOAD_V1"] = run.env["NVTE_CPU_OFFLOAD_V1"]
    unset = ["CUDA_DEVICE_MAX_CONNECTIONS"] if value is None else []
    return env, unset, run.program_args()


def validated(megatron, argv: list[str], world: int, arch: int, env: dict[str, str] | None = None):
    """Megatron's parse_args + validate_args as `torchrun --nproc... pretrain_gpt.py ARGV` runs them
    on rank 0 of `world`, with only `env` set of the variables validate_args reads; the device's
    compute capability (--moe-grouped-gemm asks for it) is the plan's GPU generation."""
    import torch

    environ = {k: v for k, v in os.environ.items() if k != "CUDA_DEVICE_MAX_CONNECTIONS"}
    environ |= {"WORLD_SIZE": str(world), "RANK": "0", **(env or {})}
    with mock.patch.object(sys, "argv", ["pretrain_gpt.py", *argv]), mock.patch.dict(os.environ, environ, clear=True), \
            mock.patch.object(megatron, "get_device_arch_version", lambda: arch), \
            mock.patch.object(torch.cuda, "get_device_capability", lambda device=None: (arch, 0)), \
            contextlib.redirect_stdout(io.StringIO()):  # validate_args prints every argument
        args = megatron.parse_args()
        megatron.validate_args(args)
    return args


def transformer_config(args):
    """Megatron's TransformerConfig of the validated arguments (it checks the pipeline layout, the
    recompute settings and the head/tp shapes). Transformer Engine is not in the CPU tier, and
    TransformerConfig refuses its fused RoPE kernel without it: a kernel choice, not a plan value."""
    try:  # 0.18 and later
        from megatron.training.argument_utils import core_transformer_config_from_args
    except ImportError:  # 0.17
        from megatron.training.arguments import core_transformer_config_from_args

    args.apply_rope_fusion = False
    with contextlib.redirect_stdout(io.StringIO()):
        return core_transformer_config_from_args(args)


def megatron_stage_layers(config) -> tuple[int, ...]:
    """Decoder layers per virtual stage as Megatron builds them, in stage order (k = vpp_rank*pp + pp_rank)."""
    from megatron.core.transformer.enums import LayerType
    from megatron.core.transformer.transformer_block import get_num_layers_to_build

    pp, vpp = config.pipeline_model_parallel_size, config.virtual_pipeline_model_parallel_size or 1
    layout = config.pipeline_model_parallel_layout
    if layout is not None:
        return tuple(layout.layout[r][v].count(LayerType.decoder) for v in range(vpp) for r in range(pp))
    return tuple(get_num_layers_to_build(config, vp_stage=v if vpp > 1 else None, pp_rank=r)
                 for v in range(vpp) for r in range(pp))


def megatron_groups(args, name: str) -> set[tuple[int, ...]]:
    """Rank groups Megatron's initialize_model_parallel builds for `name` from the parsed arguments."""
    from megatron.core.parallel_state import RankGenerator

    generator = RankGenerator(tp=args.tensor_model_parallel_size, ep=1, dp=args.data_parallel_size,
                              pp=args.pipeline_model_parallel_size, cp=args.context_parallel_size,
                              order=MEGATRON_ORDER[args.use_tp_pp_dp_mapping])
    return {tuple(group) for group in generator.get_ranks(name)}


def plan_groups(plan: Plan, name: str) -> set[tuple[int, ...]]:
    return {tuple(group) for group in plan.rankmap.groups[name]}


def assert_values_match(args, config, plan: Plan) -> None:
    layout, model = plan.layout, plan.model
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size) == (layout.tp, layout.pp)
    assert (args.virtual_pipeline_model_parallel_size or 1) == layout.vpp
    assert (args.data_parallel_size, args.context_parallel_size) == (layout.dp, layout.cp)
    assert (args.micro_batch_size, args.global_batch_size) == (layout.micro_batch, plan.training.global_batch)
    assert args.sequence_parallel == layout.sequence_parallel
    assert args.seq_length == (plan.training.seq_len or model.seq_len)
    assert_zero_matches(args, load_engine("megatron-core").zero_read_as(layout).zero)  # ZeRO-2 with pp: ZeRO-1
    assert (args.recompute_granularity or "none") == layout.recompute
    if layout.recompute == "full":
        assert (args.recompute_method, args.recompute_num_layers) == ("uniform", 1)
    assert (config.num_layers, config.hidden_size, config.num_attention_heads) == (model.layers, model.hidden,
                                                                                   model.heads)
    assert (config.num_query_groups or config.num_attention_heads) == model.kv_heads_
    assert (config.ffn_hidden_size, config.kv_channels) == (model.ffn_hidden_, model.head_dim_)
    assert megatron_stage_layers(config) == layout.stage_layers(model.layers)
    assert config.hidden_dropout == config.attention_dropout == model.dropout  # what the activations budget
    if plan.training.precision in ("bf16", "fp16", "fp8"):  # the gradient buffer the memory budgets
        assert args.accumulate_allreduce_grads_in_fp32 == (plan.grad_dtype == "fp32")
    for name in ("tp", "pp", "dp"):
        assert megatron_groups(args, name) == plan_groups(plan, name), f"{name} groups differ"


def assert_zero_matches(args, zero: int) -> None:
    assert args.use_distributed_optimizer == (zero >= 1)  # Megatron-FSDP turns it on too
    assert args.use_megatron_fsdp == (zero >= 2)
    if zero >= 2:
        assert args.data_parallel_sharding_strategy == FSDP_STRATEGY[zero]


def assert_fsdp_mesh_refuses_pipeline(megatron, plan: Plan) -> None:
    """Megatron-FSDP with pp > 1: validate_args accepts the flags, but the device mesh Megatron-FSDP
    builds (mcore_fsdp_adapter._get_dp_tp_mesh, 0.19.2) lays every rank out as dp x cp x ep x tp
    and fails when pipeline stages hold the rest of the world."""
    from megatron.core.distributed.fsdp import mcore_fsdp_adapter

    layout = plan.layout
    argv = fsdp_argv(plan)
    args = validated(megatron, argv, layout.world_size, arch=9)
    assert args.use_megatron_fsdp and args.pipeline_model_parallel_size == layout.pp > 1
    dp_group = mock.Mock(size=lambda: args.data_parallel_size * args.context_parallel_size)
    with mock.patch.object(mcore_fsdp_adapter.dist, "get_world_size",
                           lambda group=None: layout.world_size if group is None else layout.tp), \
            pytest.raises(require("einops").EinopsError, match=f"Shape mismatch, {layout.world_size} != "):
        mcore_fsdp_adapter._get_dp_tp_mesh(dp_group, tp_group=mock.Mock())


def fsdp_argv(plan: Plan) -> list[str]:
    """The arguments the plan would need: the same plan's arguments at pp=1 with its pp put back."""
    flat = plan.layout.model_copy(update={"pp": 1, "dp": plan.layout.dp})
    flat_plan = plan.model_copy(update={"layout": flat})
    _, _, argv = shell_parts(emit_megatron(flat_plan, RUN).text)
    at = argv.index("--pipeline-model-parallel-size")
    return argv[:at + 1] + [str(plan.layout.pp)] + argv[at + 2:]


def assert_no_megatron_order_builds(megatron, plan: Plan) -> None:
    """Megatron builds ranks in tp-cp-ep-dp-pp or, with --use-tp-pp-dp-mapping, tp-cp-ep-pp-dp
    (megatron/training/initialize.py); neither makes the plan's tp, pp and dp groups."""
    base = fsdp_free_argv(plan)
    for mapping in ([], ["--use-tp-pp-dp-mapping"]):
        args = validated(megatron, base + mapping, plan.layout.world_size, arch=9,
                         env={"CUDA_DEVICE_MAX_CONNECTIONS": "1"})
        assert any(megatron_groups(args, name) != plan_groups(plan, name) for name in ("tp", "pp", "dp"))


def fsdp_free_argv(plan: Plan) -> list[str]:
    default = plan.model_copy(update={"layout": plan.layout.model_copy(update={"order": "tp-cp-ep-dp-pp"})})
    _, _, argv = shell_parts(emit_megatron(default, RUN).text)
    return argv


# plan3d refuses these; the function shows Megatron's own code cannot run what they need.
REFUSALS = {
    "pp4-dp8-zero3": assert_fsdp_mesh_refuses_pipeline,
    "tp2-pp2-dp8-dp-first-order": assert_no_megatron_order_builds,
}


@pytest.mark.parametrize("case", CASES, ids=case_ids())
def test_megatron_runs_the_plan_or_confirms_the_refusal(megatron, case: Case):
    plan = build(case)
    try:
        emitted = emit_megatron(plan, RUN)
    except InfeasibleError:
        assert case.name in REFUSALS, f"plan3d refuses {case.name}, which Megatron-Core 0.19 may run"
        REFUSALS[case.name](megatron, plan)
        return
    assert case.name not in REFUSALS, f"{case.name} is emitted, but Megatron's code refuses it"
    if plan.layout.zero == 2 and plan.layout.pp > 1:  # read as the distributed optimizer, as estimate reads it
        assert any("read as megatron-core's distributed optimizer" in note for note in emitted.notes)
    env, unset, argv = shell_parts(emitted.text)
    args = validated(megatron, argv, plan.layout.world_size, gpu_arch(plan), env)
    assert_values_match(args, transformer_config(args), plan)


@pytest.mark.parametrize("cp_comm", ["p2p", "all_gather", "a2a"])
def test_context_parallel_exchange_reaches_the_transformer_config(megatron, cp_comm):
    """A plan made with --cp-comm: Megatron parses --cp-comm-type, validate_args accepts it with
    the plan's cp, and TransformerConfig.cp_comm_type is what the time model priced."""
    case = next(c for c in CASES if c.name == "tp4-cp2-pp2-dp2-seq16k")
    engine = load_engine("megatron-core").with_cp_comm(cp_comm)
    plan = build(case).model_copy(update={"engine": engine})
    env, _, argv = shell_parts(emit_megatron(plan, RUN).text)
    args = validated(megatron, argv, plan.layout.world_size, gpu_arch(plan), env)
    config = transformer_config(args)
    assert config.context_parallel_size == plan.layout.cp == 2
    assert config.cp_comm_type == cp_comm == plan.engine.runs_as.cp_comm


def test_max_connections_is_what_validate_args_needs_before_blackwell(megatron):
    """Without the exported variable, validate_args refuses tp > 1 on Hopper: the line is needed."""
    plan = build(next(c for c in CASES if c.name == "tp2-dp4-zero1-sp"))
    env, _, argv = shell_parts(emit_megatron(plan, RUN).text)
    assert env == {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    with pytest.raises(AssertionError, match="CUDA_DEVICE_MAX_CONNECTIONS"):
        validated(megatron, argv, plan.layout.world_size, arch=9)


def test_blackwell_needs_no_max_connections(megatron):
    plan = build_plan(load_cluster("gb200-nvl72"), load_model("llama3-8b"), TrainingSpec(global_batch=72),
                      Layout(tp=4, dp=18, zero=1, sequence_parallel=True))
    env, _, argv = shell_parts(emit_megatron(plan, RUN).text)
    assert gpu_arch(plan) == 10 and env == {}
    args = validated(megatron, argv, plan.layout.world_size, gpu_arch(plan), env)
    assert args.tensor_model_parallel_size == 4 and args.tp_comm_overlap


def test_megatron_fsdp_refuses_max_connections_one(megatron):
    """The emitter unsets the variable for ZeRO-2/3: validate_args asserts it is not 1 with Megatron-FSDP."""
    plan = build(next(c for c in CASES if c.name == "tp4-dp8-zero3"))
    env, unset, argv = shell_parts(emit_megatron(plan, RUN).text)
    assert unset == ["CUDA_DEVICE_MAX_CONNECTIONS"] and "CUDA_DEVICE_MAX_CONNECTIONS" not in env
    with pytest.raises(AssertionError, match="CUDA_DEVICE_MAX_CONNECTIONS"):
        validated(megatron, argv, plan.layout.world_size, arch=9, env={"CUDA_DEVICE_MAX_CONNECTIONS": "1"})


def test_overlap_flags_the_time_model_assumes_are_on(megatron):
    plan = build(next(c for c in CASES if c.name == "tp2-dp4-zero1-sp"))
    env, _, argv = shell_parts(emit_megatron(plan, RUN).text)
    args = validated(megatron, argv, plan.layout.world_size, 9, env)
    assert args.overlap_grad_reduce and args.overlap_param_gather and args.tp_comm_overlap
    assert args.rotary_base == 500000 == plan.model.rope_theta


def test_without_run_arguments_the_script_requires_them_and_then_validates(megatron):
    """Without data/tokenizer/schedule the script stops before torchrun, naming the first missing
    setting; with them in the environment, pretrain_gpt.py gets them and validate_args passes."""
    plan = build(CASES[0])
    text = emit_megatron(plan).text
    for missing in ("MEGATRON_LM", "DATA_PATH", "TOKENIZER", "TRAIN_ITERS", "LR"):
        env = {k: v for k, v in REQUIRED_DEFAULTS.items() if k != missing}
        run = run_script(text, env, fill_required=False)
        assert run.returncode != 0 and run.argv == [] and f"set {missing} " in run.stderr, run.stderr
    env = {"DATA_PATH": "/data/web_text_document", "TOKENIZER": "null", "TRAIN_ITERS": "7", "LR": "2e-4"}
    run = run_script(text, env)
    args = validated(megatron, run.program_args(), plan.layout.world_size, 9,
                     {"CUDA_DEVICE_MAX_CONNECTIONS": run.env["CUDA_DEVICE_MAX_CONNECTIONS"]})
    assert (args.train_iters, args.lr, args.data_path, args.tokenizer_type) == \
        (7, 2e-4, ["/data/web_text_document"], "NullTokenizer")
    assert args.save == args.load and args.save.endswith("/checkpoints") and args.save_interval == 7


def test_the_launcher_is_a_torchrun_torch_parses_with_the_plans_placement():
    """torchrun's own parser reads the script's launcher: static rendezvous, the plan's nodes and
    processes per node, per-node log directory, no restarts."""
    from torch.distributed.run import get_args_parser

    plan = build(next(c for c in CASES if c.name == "tp2-dp4-zero1-sp"))
    run = run_script(emit_megatron(plan, RUN).text, {"NODE_RANK": "0"})
    parsed = get_args_parser().parse_args(run.argv)
    assert parsed.training_script.endswith("/pretrain_gpt.py") and parsed.rdzv_backend == "static"
    assert int(parsed.nproc_per_node) * int(parsed.nnodes) == plan.layout.world_size
    assert parsed.node_rank == 0 and parsed.max_restarts == 0 and parsed.log_dir.endswith("/logs/node0")
    assert parsed.training_script_args == run.program_args()


def test_moe_model_experts_reach_megatron(megatron):
    """A MoE model spec (experts every second layer) with expert parallelism: validate_args asserts
    num_experts with ep > 1 and divides the experts over ep."""
    dense = load_model("llama3-8b")
    moe = dense.model_copy(update={"moe": MoESpec(experts=8, top_k=2, every=2)})
    plan = build_plan(load_cluster("dgx-h100", nodes=1), moe, TrainingSpec(global_batch=64),
                      Layout(tp=2, dp=4, ep=4, zero=1, sequence_parallel=True))
    env, _, argv = shell_parts(emit_megatron(plan, RUN).text)
    args = validated(megatron, argv, plan.layout.world_size, 9, env)
    assert (args.num_experts, args.moe_router_topk, args.expert_model_parallel_size) == (8, 2, 4)
    assert args.moe_layer_freq == 2 and args.moe_ffn_hidden_size == dense.ffn_hidden_


@pytest.mark.parametrize("precision,fp32_grads", [("bf16", False), ("fp16", True), ("bf16", None), ("fp16", None)])
def test_megatron_keeps_the_gradient_buffer_the_plan_budgets(megatron, precision, fp32_grads):
    """--grad-reduce-in-bf16 / --accumulate-allreduce-grads-in-fp32 where the plan's gradient dtype
    is not Megatron's default; validate_args then keeps (or drops) fp32 accumulation as budgeted."""
    training = TrainingSpec(global_batch=64, precision=precision, fp32_grad_accum=fp32_grads)
    plan = build_plan(load_cluster("dgx-h100", nodes=1), load_model("llama3-8b"), training,
                      Layout(tp=2, dp=4, zero=1, sequence_parallel=True), engine=load_engine("megatron-core"))
    env, _, argv = shell_parts(emit_megatron(plan, RUN).text)
    args = validated(megatron, argv, plan.layout.world_size, arch=9, env=env)
    assert args.accumulate_allreduce_grads_in_fp32 == (plan.grad_dtype == "fp32")
    assert plan.grad_dtype == {("bf16", None): "fp32", ("fp16", None): "fp16"}.get((precision, fp32_grads),
                                                                                 "fp32" if fp32_grads else "bf16")


def test_partial_recompute_reaches_the_transformer_config(megatron):
    """Partial recompute of a plan made by `recommend --out` (its estimate chose N): validate_args
    and TransformerConfig take full granularity, the block method and the estimate's N, which
    TransformerBlock applies to the first N layers of each (virtual) chunk."""
    from plan3d.cost.estimate import estimate

    cluster, model = load_cluster("dgx-a100-80g", 64), load_model("gpt3-175b")
    training = TrainingSpec(global_batch=1536)
    layout = Layout(tp=8, pp=8, dp=8, vpp=2, micro_batch=2, zero=1, recompute="partial")
    engine = load_engine("megatron-core")
    est = estimate(cluster, model, training, layout, engine=engine).to_dict()
    assert est["recompute_layers"] >= 1
    plan = build_plan(cluster, model, training, layout, est, engine)
    env, _, argv = shell_parts(emit_megatron(plan, RUN).text)
    args = validated(megatron, argv, layout.world_size, gpu_arch(plan), env)
    config = transformer_config(args)
    assert (config.recompute_granularity, config.recompute_method) == ("full", "block")
    assert config.recompute_num_layers == est["recompute_layers"]
    assert megatron_stage_layers(config) == layout.stage_layers(model.layers)
