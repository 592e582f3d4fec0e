"""Mixture-of-experts plans through the engines' own code (megatron-core 0.19.2, torchtitan 0.3.0,
deepspeed 0.19.8).

Megatron-Core: the emitted block goes through `parse_args` + `validate_args`, its
`TransformerConfig` / `MLATransformerConfig`, its layer specs (`get_gpt_decoder_layer_specs`: which
layers get a MoE MLP) and `initialize_model_parallel` on a fake process group, once per rank, whose
tp, pp, dp, cp, expert-parallel, expert-data-parallel and expert-tensor-parallel groups must be
plan3d's rank map groups; its GPTModel, built on the meta device, has plan3d's parameter count, and
built as one rank of the plan, the dense and expert parameters of plan3d's accounting contract.
Refused plans are confirmed by the Megatron code that refuses them.

DeepSpeed: the AutoEP section parsed by `DeepSpeedConfig` and `validate_autoep_config`, the groups
built by DeepSpeed's `_create_expert_and_data_parallel`. torchtitan: the DeepSeek-shaped job loaded
by `ConfigManager`, its model built on the meta device (plan3d's parameter count), its
`ParallelDims.build_mesh` on a fake process group (plan3d's ep and edp groups).

The models are built here (small layer counts, real shapes of the families): Mixtral-like (8 experts
top-2, GQA, SwiGLU, every layer MoE), DeepSeek-like (first dense layer, shared experts, sigmoid
router with expert bias, MLA), Qwen2-MoE-like (shared experts with their sigmoid gate, Q/K/V
biases), a GPT-style MoE with biases (GELU, LayerNorm, experts every second layer).
"""
from __future__ import annotations

import contextlib
import io
from dataclasses import dataclass, field
from unittest import mock

import pytest

from conftest import require
from test_megatron_engine import RUN, shell_parts, transformer_config, validated
from test_torchtitan_engine import check_batch, check_pipeline, check_recompute, load_job, titan  # noqa: F401 (fixtures)
from plan3d.emit.megatron import emit_megatron, gpu_arch
from plan3d.errors import InfeasibleError
from plan3d.layout import Layout
from plan3d.plan import Plan, build_plan
from plan3d.specs.catalog import load_cluster
from plan3d.specs.model import MLASpec, ModelSpec, MoESpec
from plan3d.specs.training import TrainingSpec

LLAMA_PARTS = dict(activation="swiglu", norm="rmsnorm", bias=False, position="rope", vocab=32000, seq_len=4096)
MODELS = {
    "mixtral": ModelSpec(name="mixtral-like", layers=8, hidden=1024, heads=16, kv_heads=4, ffn_hidden=3584,
                         rope_theta=1e6, moe=MoESpec(experts=8, top_k=2), **LLAMA_PARTS),
    "mixtral-cf": ModelSpec(name="mixtral-like-cf", layers=8, hidden=1024, heads=16, kv_heads=4, ffn_hidden=3584,
                            rope_theta=1e6, moe=MoESpec(experts=8, top_k=2, capacity_factor=1.25), **LLAMA_PARTS),
    "deepseek": ModelSpec(name="deepseek-like", layers=6, hidden=1024, heads=16, ffn_hidden=4096,
                          moe=MoESpec(experts=16, top_k=4, expert_ffn_hidden=512, shared_ffn_hidden=1024,
                                      first_dense_layers=1, router="sigmoid"),
                          mla=MLASpec(q_lora_rank=384, kv_lora_rank=256, qk_nope_head_dim=64, qk_rope_head_dim=32,
                                      v_head_dim=64), **LLAMA_PARTS),
    "qwen2moe": ModelSpec(name="qwen2-moe-like", layers=4, hidden=1024, heads=16, kv_heads=16, ffn_hidden=2816,
                          qkv_bias=True, rope_theta=1e6,
                          moe=MoESpec(experts=8, top_k=4, expert_ffn_hidden=512, shared_ffn_hidden=2048,
                                      shared_expert_gate=True), **LLAMA_PARTS),
    "gpt-moe": ModelSpec(name="gpt-moe", layers=8, hidden=1024, heads=16, activation="gelu", norm="layernorm",
                         bias=True, position="learned", vocab=50304, seq_len=2048,
                         moe=MoESpec(experts=8, top_k=2, every=2)),
}


@dataclass(frozen=True)
class MoECase:
    name: str
    model: str
    nodes: int
    layout: dict
    global_batch: int = 64
    seq_len: int | None = None
    tags: tuple[str, ...] = field(default=())


MOE_CASES = [
    MoECase("mixtral-ep8-dp8-zero1", "mixtral", 1, dict(dp=8, ep=8, zero=1)),
    MoECase("mixtral-tp2-ep4-dp4-sp", "mixtral", 1, dict(tp=2, dp=4, ep=4, zero=1, sequence_parallel=True)),
    MoECase("mixtral-tp2-pp2-ep2-dp4", "mixtral", 2, dict(tp=2, pp=2, dp=4, ep=2, zero=1, sequence_parallel=True)),
    MoECase("mixtral-tp4-pp2-vpp2-ep2-dp2", "mixtral", 2, dict(tp=4, pp=2, vpp=2, dp=2, ep=2, zero=1,
                                                              sequence_parallel=True, recompute="selective")),
    MoECase("mixtral-tp2-ep4-dp4-sp-moe-act", "mixtral", 1, dict(tp=2, dp=4, ep=4, zero=1, sequence_parallel=True,
                                                                recompute="moe-act")),
    MoECase("mixtral-tp2-ep4-dp4-sp-moe", "mixtral", 1, dict(tp=2, dp=4, ep=4, zero=1, sequence_parallel=True,
                                                            recompute="moe")),
    MoECase("mixtral-tp2-cp2-ep4-dp4", "mixtral", 2, dict(tp=2, cp=2, dp=4, ep=4, zero=1, sequence_parallel=True),
            seq_len=8192),
    MoECase("mixtral-ep4-dp8-zero3", "mixtral", 1, dict(dp=8, ep=4, zero=3)),
    MoECase("mixtral-ppdp-order-ep-eq-cp", "mixtral", 2, dict(tp=2, cp=2, pp=2, dp=2, ep=2, zero=1,
                                                             sequence_parallel=True, order="tp-cp-ep-pp-dp"),
            seq_len=8192),
    MoECase("mixtral-cf-ep2-dp8", "mixtral-cf", 1, dict(dp=8, ep=2, zero=1)),
    MoECase("deepseek-tp2-pp2-ep4-dp4-mla", "deepseek", 2, dict(tp=2, pp=2, dp=4, ep=4, zero=1, sequence_parallel=True)),
    MoECase("deepseek-ep8-dp16-full", "deepseek", 2, dict(dp=16, ep=8, zero=1, recompute="full")),
    MoECase("qwen2moe-tp2-ep2-dp4-gate", "qwen2moe", 1, dict(tp=2, dp=4, ep=2, zero=1, sequence_parallel=True)),
    MoECase("gpt-moe-ep4-dp8-bias", "gpt-moe", 1, dict(dp=8, ep=4, zero=1)),
    # MoE Parallel Folding: the experts' own tensor-parallel degree, ep folded over tp x cp x dp
    MoECase("mixtral-tp2-ep8-etp1-dp4", "mixtral", 1, dict(tp=2, dp=4, ep=8, etp=1, zero=1, sequence_parallel=True)),
    MoECase("mixtral-tp4-pp2-ep4-etp2-dp2", "mixtral", 2, dict(tp=4, pp=2, dp=2, ep=4, etp=2, zero=1,
                                                              sequence_parallel=True)),
    MoECase("mixtral-tp2-cp2-ep8-etp1-dp2", "mixtral", 1, dict(tp=2, cp=2, dp=2, ep=8, etp=1, zero=1,
                                                              sequence_parallel=True), seq_len=8192),
    # refused by plan3d (REFUSALS says how Megatron's own code refuses them)
    MoECase("mixtral-ep16-over-8-experts", "mixtral", 2, dict(dp=16, ep=16, zero=1)),
    MoECase("mixtral-tp2-no-sp", "mixtral", 1, dict(tp=2, dp=4, ep=2, zero=1)),
    MoECase("mixtral-tp2-ep1-no-sp", "mixtral", 1, dict(tp=2, dp=4, zero=1)),  # MoELayer raises at ep = 1 too
    MoECase("gpt-moe-bias-tp2", "gpt-moe", 1, dict(tp=2, dp=4, ep=2, zero=1, sequence_parallel=True)),
    MoECase("mixtral-ppdp-order-ep2-cp1", "mixtral", 2, dict(tp=2, pp=2, dp=4, ep=2, zero=1, sequence_parallel=True,
                                                            order="tp-cp-ep-pp-dp")),
]


def build_moe(case: MoECase) -> Plan:
    cluster = load_cluster("dgx-h100", nodes=case.nodes)
    training = TrainingSpec(global_batch=case.global_batch, seq_len=case.seq_len)
    return build_plan(cluster, MODELS[case.model], training, Layout(**case.layout))


@pytest.fixture(scope="module")
def megatron():
    return require("megatron.training.arguments")


def megatron_args(megatron, plan: Plan, argv: list[str] | None = None, env: dict | None = None):
    if argv is None:
        env, _, argv = shell_parts(emit_megatron(plan, RUN).text)
    return validated(megatron, argv, plan.layout.world_size, gpu_arch(plan), env)


# ---- Megatron's process groups, built by its own initialize_model_parallel ------------------------
MEGATRON_GROUPS = {  # plan3d rank map group -> parallel_state getter
    "tp": "get_tensor_model_parallel_group", "pp": "get_pipeline_model_parallel_group",
    "dp": "get_data_parallel_group", "cp": "get_context_parallel_group",
    "ep": "get_expert_model_parallel_group", "edp": "get_expert_data_parallel_group",
    "etp": "get_expert_tensor_parallel_group",
}


def megatron_process_groups(args) -> dict[str, set[tuple[int, ...]]]:
    """Every rank's groups as `initialize_model_parallel` builds them from the validated arguments,
    one rank at a time on torch's fake process group (no communication, real group membership)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from megatron.core import parallel_state

    assert not dist.is_initialized(), "another test left torch.distributed initialized"
    world = args.world_size
    found = {name: set() for name in MEGATRON_GROUPS}
    for rank in range(world):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                initialize_from_args(parallel_state, args)
            for name, getter in MEGATRON_GROUPS.items():
                found[name].add(tuple(dist.get_process_group_ranks(getattr(parallel_state, getter)())))
        finally:
            parallel_state.destroy_model_parallel()
            dist.destroy_process_group()
    return found


def initialize_from_args(parallel_state, args) -> None:
    """megatron/training/initialize.py `_initialize_distributed`'s call, without gloo groups."""
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
        context_parallel_size=args.context_parallel_size,
        expert_model_parallel_size=args.expert_model_parallel_size,
        expert_tensor_parallel_size=args.expert_tensor_parallel_size,
        order="tp-cp-ep-pp-dp" if args.use_tp_pp_dp_mapping else "tp-cp-ep-dp-pp",
        create_gloo_process_groups=False)


def plan_groups(plan: Plan) -> dict[str, set[tuple[int, ...]]]:
    groups = {name: {tuple(g) for g in plan.rankmap.groups[name]} for name in ("tp", "pp", "dp", "cp", "ep", "edp")}
    etp = plan.rankmap.groups.get("etp")  # its own groups with an etp other than tp, else tp's
    return groups | {"etp": {tuple(g) for g in etp} if etp else groups["tp"]}


def megatron_moe_layers(config) -> list[bool]:
    """Which layers Megatron builds with a MoE MLP (its layer specs, local implementation)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_layer_specs
    from megatron.core.transformer.moe.moe_layer import MoELayer

    specs = get_gpt_decoder_layer_specs(config, use_transformer_engine=False)
    mlps = [spec.submodules.mlp for spec in specs]  # a ModuleSpec or a functools.partial of the class
    return [getattr(mlp, "module", getattr(mlp, "func", None)) is MoELayer for mlp in mlps]


def assert_moe_values(args, config, plan: Plan) -> None:
    model, layout, moe = plan.model, plan.layout, plan.model.moe
    assert (config.num_moe_experts, config.moe_router_topk) == (moe.experts, moe.top_k)
    assert config.moe_ffn_hidden_size == (moe.expert_ffn_hidden or model.ffn_hidden_)
    assert (config.expert_model_parallel_size, config.expert_tensor_parallel_size) == (layout.ep, layout.expert_tp)
    assert megatron_moe_layers(config) == [model.is_moe_layer(i) for i in range(model.layers)]
    assert config.moe_shared_expert_intermediate_size == (moe.shared_ffn_hidden or None)
    assert config.moe_shared_expert_gate == moe.shared_expert_gate
    assert config.moe_router_score_function == moe.router
    assert config.moe_router_enable_expert_bias == (moe.router == "sigmoid")
    assert config.moe_expert_capacity_factor == moe.capacity_factor
    assert config.moe_pad_expert_input_to_capacity == (moe.capacity_factor is not None)
    assert config.moe_token_dispatcher_type == "alltoall" and config.moe_grouped_gemm
    assert config.add_bias_linear == model.bias and config.add_qkv_bias == model.qkv_bias_
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size) == (layout.tp, layout.pp)
    assert (args.data_parallel_size, args.context_parallel_size) == (layout.dp, layout.cp)
    assert_attention(args, config, model)


def assert_attention(args, config, model: ModelSpec) -> None:
    mla = model.mla
    assert config.multi_latent_attention == (mla is not None)
    if mla is None:
        assert (config.num_query_groups or config.num_attention_heads) == model.kv_heads_
        return
    assert type(config).__name__ == "MLATransformerConfig" and config.rope_type == "rope"
    assert (config.q_lora_rank, config.kv_lora_rank) == (mla.q_lora_rank, mla.kv_lora_rank)
    assert (config.qk_head_dim, config.qk_pos_emb_head_dim, config.v_head_dim) == (
        mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim)
    assert not args.group_query_attention  # validate_args: GQA excludes MLA


# ---- refusals, each confirmed by the Megatron code that refuses ------------------------------------
def argv_with(plan: Plan, base_layout: dict, replace: dict[str, str], add: tuple[str, ...] = ()) -> list[str]:
    """The arguments the plan would need: a runnable neighbour's arguments with values replaced."""
    neighbour = plan.model_copy(update={"layout": Layout(**base_layout)})
    _, _, argv = shell_parts(emit_megatron(neighbour, RUN).text)
    for flag, value in replace.items():
        argv[argv.index(flag) + 1] = value
    return argv + list(add)


def confirm_experts_not_divisible(megatron, plan: Plan) -> None:
    argv = argv_with(plan, dict(dp=16, ep=8, zero=1), {"--expert-model-parallel-size": "16"})
    with pytest.raises(AssertionError, match="multiple of expert model parallel"):
        megatron_args(megatron, plan, argv)


def confirm_moe_needs_sequence_parallel(megatron, plan: Plan) -> None:
    """MoELayer.forward itself raises when training with tp > 1 and no sequence parallelism."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    args = megatron_args(megatron, plan, argv_with(plan, dict(dp=8, ep=plan.layout.ep, zero=1), {
        "--tensor-model-parallel-size": "2", "--expert-tensor-parallel-size": "2"}),
        env={"CUDA_DEVICE_MAX_CONNECTIONS": "1"})
    assert not args.sequence_parallel and args.expert_model_parallel_size == plan.layout.ep
    layer = mock.Mock(training=True, config=transformer_config(args))
    layer.attn_tp_group.size.return_value = args.tensor_model_parallel_size
    with pytest.raises(ValueError, match="without also enabling sequence parallelism"):
        MoELayer.forward(layer, hidden_states=mock.Mock())


def confirm_expert_bias_needs_etp_one(megatron, plan: Plan) -> None:
    args = megatron_args(megatron, plan, argv_with(plan, dict(dp=8, ep=2, zero=1), {
        "--tensor-model-parallel-size": "2", "--expert-tensor-parallel-size": "2"}, ("--sequence-parallel",)),
        env={"CUDA_DEVICE_MAX_CONNECTIONS": "1"})
    with pytest.raises(AssertionError, match="Bias in Moe is only supported when ETP==1"):
        transformer_config(args)


def confirm_ppdp_order_needs_equal_dp(megatron, plan: Plan) -> None:
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from megatron.core import parallel_state

    args = megatron_args(megatron, plan, argv_with(plan, dict(tp=2, pp=2, dp=4, ep=2, zero=1, sequence_parallel=True),
                                                   {}, ("--use-tp-pp-dp-mapping",)),
                         env={"CUDA_DEVICE_MAX_CONNECTIONS": "1"})
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=args.world_size)
    try:
        with pytest.raises(AssertionError, match="data parallel size of the attention and moe layers must be the same"):
            initialize_from_args(parallel_state, args)
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


REFUSALS = {
    "mixtral-ep16-over-8-experts": ("does not divide the 8 experts", confirm_experts_not_divisible),
    "mixtral-tp2-no-sp": ("set sequence_parallel", confirm_moe_needs_sequence_parallel),
    "mixtral-tp2-ep1-no-sp": ("set sequence_parallel", confirm_moe_needs_sequence_parallel),
    "gpt-moe-bias-tp2": ("experts with biases", confirm_expert_bias_needs_etp_one),
    "mixtral-ppdp-order-ep2-cp1": ("tp-cp-ep-pp-dp with pp > 1", confirm_ppdp_order_needs_equal_dp),
}


@pytest.mark.parametrize("case", MOE_CASES, ids=[c.name for c in MOE_CASES])
def test_megatron_runs_the_moe_plan_or_confirms_the_refusal(megatron, case: MoECase):
    plan = build_moe(case)
    try:
        emitted = emit_megatron(plan, RUN)
    except InfeasibleError as err:
        assert case.name in REFUSALS, f"plan3d refuses {case.name}: {err}"
        reason, confirm = REFUSALS[case.name]
        assert reason in str(err)
        confirm(megatron, plan)
        return
    assert case.name not in REFUSALS, f"{case.name} is emitted, but Megatron's code refuses it"
    env, _, argv = shell_parts(emitted.text)
    args = megatron_args(megatron, plan, argv, env)
    assert_moe_values(args, transformer_config(args), plan)
    assert megatron_process_groups(args) == plan_groups(plan)


def test_megatron_recomputes_the_modules_moe_act_names(megatron):
    """plan3d's moe-act is Megatron-Core's selective recompute of exactly the MoE activation and the
    norms, as TransformerConfig reads the emitted arguments (grouped GEMM on, which moe_act needs)."""
    case = next(c for c in MOE_CASES if c.name == "mixtral-tp2-ep4-dp4-sp-moe-act")
    plan = build_moe(case)
    env, _, argv = shell_parts(emit_megatron(plan, RUN).text)
    config = transformer_config(megatron_args(megatron, plan, argv, env))
    assert config.recompute_granularity == "selective"
    assert config.recompute_modules == ["moe_act", "layernorm"] and config.moe_grouped_gemm


def test_megatron_recomputes_the_whole_moe_layer_for_moe(megatron):
    """plan3d's moe is Megatron-Core's selective recompute of the MoE layer and the norms: the
    MoELayer checkpoints its whole forward (moe_layer_recompute), as TransformerConfig reads it."""
    case = next(c for c in MOE_CASES if c.name == "mixtral-tp2-ep4-dp4-sp-moe")
    plan = build_moe(case)
    env, _, argv = shell_parts(emit_megatron(plan, RUN).text)
    config = transformer_config(megatron_args(megatron, plan, argv, env))
    assert config.recompute_granularity == "selective" and config.recompute_modules == ["moe", "layernorm"]


@pytest.mark.parametrize("dispatcher", ["deepep", "hybridep"])
def test_megatron_runs_the_hierarchical_dispatcher_the_plan_was_predicted_with(megatron, dispatcher):
    """A plan predicted with --ep-dispatcher deepep / hybridep is emitted as Megatron-Core's flex
    dispatcher with that backend, which TransformerConfig reads back (and its groups are the plan's)."""
    from plan3d.specs.catalog import load_engine
    case = next(c for c in MOE_CASES if c.name == "deepseek-tp2-pp2-ep4-dp4-mla")
    engine = load_engine("megatron-core").with_ep_dispatcher(dispatcher)
    base = build_moe(case)
    plan = build_plan(base.cluster, base.model, base.training, base.layout, engine=engine)
    env, _, argv = shell_parts(emit_megatron(plan, RUN).text)
    args = megatron_args(megatron, plan, argv, env)
    config = transformer_config(args)
    assert config.moe_token_dispatcher_type == "flex" and config.moe_flex_dispatcher_backend == dispatcher
    assert megatron_process_groups(args) == plan_groups(plan)


def test_megatron_runs_the_combined_1f1b_overlap_and_refuses_what_plan3d_refuses(megatron):
    """--ep-overlap combined-1f1b is --overlap-moe-expert-parallel-comm, which TransformerConfig
    reads back on a virtual pipeline (the shared-expert overlap dropped, as it asserts); without
    vpp, plan3d refuses it, and so does Megatron once the flag is added to the emitted job."""
    from plan3d.specs.catalog import load_engine
    engine = load_engine("megatron-core").with_ep_overlap("combined-1f1b")
    case = next(c for c in MOE_CASES if c.name == "mixtral-tp4-pp2-vpp2-ep2-dp2")
    base = build_moe(case)
    base = build_plan(base.cluster, base.model, base.training, base.layout.model_copy(update={"recompute": "none"}))
    plan = build_plan(base.cluster, base.model, base.training, base.layout, engine=engine)
    env, _, argv = shell_parts(emit_megatron(plan, RUN).text)
    config = transformer_config(megatron_args(megatron, plan, argv, env))
    assert config.overlap_moe_expert_parallel_comm and not config.moe_shared_expert_overlap
    flat_case = next(c for c in MOE_CASES if c.name == "mixtral-tp2-pp2-ep2-dp4")
    flat = build_moe(flat_case)
    refused = build_plan(flat.cluster, flat.model, flat.training, flat.layout, engine=engine)
    with pytest.raises(InfeasibleError, match="only on a virtual pipeline"):
        emit_megatron(refused, RUN)
    env, _, argv = shell_parts(emit_megatron(flat, RUN).text)
    with pytest.raises(AssertionError, match="virtual_pipeline_model_parallel_size"):
        transformer_config(megatron_args(megatron, flat, argv + ["--overlap-moe-expert-parallel-comm"], env))


def test_megatron_recomputes_the_mla_up_projections_for_mla_up(megatron):
    """plan3d's mla-up is Megatron-Core's selective recompute of MLA's up-projections, the experts'
    activation and the norms, as TransformerConfig reads it on an MLA model."""
    base = build_moe(next(c for c in MOE_CASES if c.name == "deepseek-tp2-pp2-ep4-dp4-mla"))
    plan = build_plan(base.cluster, base.model, base.training, base.layout.model_copy(update={"recompute": "mla-up"}))
    env, _, argv = shell_parts(emit_megatron(plan, RUN).text)
    config = transformer_config(megatron_args(megatron, plan, argv, env))
    assert config.recompute_granularity == "selective" and config.multi_latent_attention
    assert config.recompute_modules == ["mla_up_proj", "moe_act", "layernorm"]


@pytest.mark.parametrize("offload", ["experts", "all"])
def test_megatron_offloads_the_modules_the_plan_was_priced_with(megatron, offload):
    """--act-offload experts / all is Megatron-Core's fine-grained activation offloading of
    ACT_OFFLOAD_MODULES, which TransformerConfig reads back next to moe-act recompute; with moe
    recompute plan3d refuses it, and so does TransformerConfig once the flags are added."""
    from plan3d.specs.catalog import load_engine
    from plan3d.specs.engine import ACT_OFFLOAD_MODULES
    engine = load_engine("megatron-core").with_act_offload(offload)
    base = build_moe(next(c for c in MOE_CASES if c.name == "mixtral-tp2-ep4-dp4-sp-moe-act"))
    plan = build_plan(base.cluster, base.model, base.training, base.layout, engine=engine)
    env, _, argv = shell_parts(emit_megatron(plan, RUN).text)
    assert env.get("NVTE_CPU_OFFLOAD_V1") == "1"
    config = transformer_config(megatron_args(megatron, plan, argv, env))
    assert config.fine_grained_activation_offloading
    assert list(config.offload_modules) == list(ACT_OFFLOAD_MODULES[offload])
    assert config.recompute_modules == ["moe_act", "layernorm"]
    moe = build_moe(next(c for c in MOE_CASES if c.name == "mixtral-tp2-ep4-dp4-sp-moe"))
    refused = build_plan(moe.cluster, moe.model, moe.training, moe.layout, engine=engine)
    with pytest.raises(InfeasibleError, match="whole MoE block"):
        emit_megatron(refused, RUN)
    env, _, argv = shell_parts(emit_megatron(moe, RUN).text)
    flags = ["--fine-grained-activation-offloading", "--offload-modules", *ACT_OFFLOAD_MODULES[offload]]
    with pytest.raises(AssertionError, match="recomputing the entire MoE layer"):
        transformer_config(megatron_args(megatron, moe, argv + flags, dict(env, NVTE_CPU_OFFLOAD_V1="1")))


def test_megatron_refuses_deepep_with_padded_capacity_as_plan3d_does(megatron):
    """deepep with a capacity factor (which the emitter pads to): plan3d refuses it, and so does
    TransformerConfig when the emitted alltoall block is switched to flex + deepep."""
    from plan3d.specs.catalog import load_engine
    case = next(c for c in MOE_CASES if c.name == "mixtral-cf-ep2-dp8")
    base = build_moe(case)
    plan = build_plan(base.cluster, base.model, base.training, base.layout,
                      engine=load_engine("megatron-core").with_ep_dispatcher("deepep"))
    with pytest.raises(InfeasibleError, match="deepep dispatcher cannot pad experts"):
        emit_megatron(plan, RUN)
    env, _, argv = shell_parts(emit_megatron(base, RUN).text)
    at = argv.index("--moe-token-dispatcher-type")
    argv = argv[:at + 1] + ["flex", "--moe-flex-dispatcher-backend", "deepep"] + argv[at + 2:]
    with pytest.raises((ValueError, AssertionError), match="moe_pad_expert_input_to_capacity"):
        transformer_config(megatron_args(megatron, base, argv, env))


@pytest.mark.parametrize("name", ["mixtral", "qwen2moe", "gpt-moe"])
def test_megatron_builds_plan3ds_parameter_count(megatron, name):
    """Megatron's GPTModel from the emitted arguments (one rank, local layer specs, meta device) has
    exactly plan3d's total parameters: experts, shared experts and their gate, router, Q/K/V and
    expert biases all come through. (MLA is left out: Megatron's local MLA spec drops the q/kv
    latent norms that its Transformer Engine spec fuses into the up-projections, and the CPU tier
    has no Transformer Engine.) CUDA-only plumbing is stood in for: the rotary buffer's device and
    the all-to-all dispatcher's device-to-host stream."""
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from plan3d.cost.params import total_params

    plan = build_plan(load_cluster("dgx-h100", nodes=1), MODELS[name], TrainingSpec(global_batch=8), Layout(dp=1))
    env, _, argv = shell_parts(emit_megatron(plan, RUN).text)
    args = megatron_args(megatron, plan, argv, env)
    config = transformer_config(args)
    config.perform_initialization, config.use_cpu_initialization = False, True
    config.persist_layer_norm = config.gradient_accumulation_fusion = False  # Apex / TE kernels
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=1)
    try:
        initialize_from_args(parallel_state, args)
        with mock.patch.object(torch.cuda, "current_device", lambda: "cpu"), \
                mock.patch.object(torch.cuda, "Stream", lambda *a, **k: None), torch.device("meta"):
            model = GPTModel(config=config, transformer_layer_spec=get_gpt_decoder_block_spec(config, False),
                             vocab_size=plan.model.vocab, max_sequence_length=args.max_position_embeddings,
                             share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                             position_embedding_type=args.position_embedding_type)
        assert sum(p.numel() for p in model.parameters()) == total_params(plan.model)
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def megatron_rank_params(megatron, plan: Plan, rank: int) -> tuple[int, int]:
    """(dense, expert) parameters Megatron's GPTModel holds on `rank` of the plan's world, built as
    that rank (fake process group, its pipeline stage's layers, meta device); expert parameters are
    the ones Megatron marks `allreduce = False` (reduced over the expert-data-parallel group)."""
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    env, _, argv = shell_parts(emit_megatron(plan, RUN).text)
    args = megatron_args(megatron, plan, argv, env)
    config = transformer_config(args)
    config.perform_initialization, config.use_cpu_initialization = False, True
    config.persist_layer_norm = config.gradient_accumulation_fusion = False  # Apex / TE kernels
    # the CPU tier's fallbacks (torch LayerNorm, local DotProductAttention) refuse sequence and
    # context parallelism, which shape no parameter: the model is built without them
    config.sequence_parallel, config.context_parallel_size = False, 1
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=plan.layout.world_size)
    try:
        initialize_from_args(parallel_state, args)
        with mock.patch.object(torch.cuda, "current_device", lambda: "cpu"), \
                mock.patch.object(torch.cuda, "Stream", lambda *a, **k: None), torch.device("meta"):
            model = GPTModel(config=config, transformer_layer_spec=get_gpt_decoder_block_spec(config, False),
                             vocab_size=plan.model.vocab, max_sequence_length=args.max_position_embeddings,
                             pre_process=parallel_state.is_pipeline_first_stage(),
                             post_process=parallel_state.is_pipeline_last_stage(),
                             share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                             position_embedding_type=args.position_embedding_type)
        expert = sum(p.numel() for p in model.parameters() if not getattr(p, "allreduce", True))
        return sum(p.numel() for p in model.parameters()) - expert, expert
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def contract_rank_params(plan: Plan, pp_rank: int) -> tuple[float, float]:
    """(dense, expert) parameters of one rank by plan3d's accounting contract, read back from
    `plan3d.cost.memory.model_state_bytes`: its weights at ZeRO-0 are (dense + expert) x bytes, at
    ZeRO-3 dense / (dp*cp) + expert / (dp*cp/ep) times the same bytes."""
    from plan3d.cost.context import make_context
    from plan3d.cost.memory import model_state_bytes

    per_weight = make_context(None, plan.model, plan.training).weight_bytes
    weights = {zero: model_state_bytes(plan.model, plan.training, plan.layout.model_copy(update={"zero": zero}),
                                       pp_rank)["weights"] / per_weight for zero in (0, 3)}
    dense_share, expert_share = 1 / (plan.layout.dp * plan.layout.cp), plan.layout.ep / (plan.layout.dp * plan.layout.cp)
    expert = (weights[3] - dense_share * weights[0]) / (expert_share - dense_share)
    return weights[0] - expert, expert


@pytest.mark.parametrize("name", ["mixtral-tp2-ep4-dp4-sp", "mixtral-tp2-pp2-ep2-dp4", "qwen2moe-tp2-ep2-dp4-gate",
                                  "gpt-moe-ep4-dp8-bias", "mixtral-tp2-cp2-ep4-dp4"])
def test_megatron_ranks_hold_what_the_accounting_contract_says(megatron, name):
    """On the first and the last rank, Megatron's model holds the dense and expert parameter
    counts of plan3d's shared accounting contract (experts / ep local experts split over tp; router,
    norms and shared gate replicated over tp; dense part replicated over ep)."""
    plan = build_moe(next(c for c in MOE_CASES if c.name == name))
    for rank in (0, plan.layout.world_size - 1):
        pp_rank = next(group.index(rank) for group in plan.rankmap.groups["pp"] if rank in group)
        dense, expert = contract_rank_params(plan, pp_rank)
        assert megatron_rank_params(megatron, plan, rank) == (round(dense), round(expert)), f"rank {rank}"
        assert abs(dense - round(dense)) < 1e-3 and abs(expert - round(expert)) < 1e-3


def test_layer_pattern_list_is_what_megatrons_parser_evaluates(megatron):
    """First dense layers become the list form; Megatron's own moe_freq_type reads it back."""
    plan = build_moe(next(c for c in MOE_CASES if c.model == "deepseek"))
    env, _, argv = shell_parts(emit_megatron(plan, RUN).text)
    text = argv[argv.index("--moe-layer-freq") + 1]
    assert text == "([0]*1+[1]*5)"
    assert megatron.moe_freq_type(text) == [0, 1, 1, 1, 1, 1]


def test_dense_model_with_ep_is_refused_as_megatron_refuses(megatron):
    dense = MODELS["mixtral"].model_copy(update={"moe": None, "name": "dense"})
    plan = build_plan(load_cluster("dgx-h100", nodes=1), dense, TrainingSpec(global_batch=64),
                      Layout(dp=8, ep=2, zero=1))
    with pytest.raises(InfeasibleError, match="needs a MoE model"):
        emit_megatron(plan, RUN)
    flat = plan.model_copy(update={"layout": Layout(dp=8, zero=1)})
    _, _, argv = shell_parts(emit_megatron(flat, RUN).text)
    with pytest.raises(AssertionError, match="num_experts must be non None"):
        megatron_args(megatron, plan, argv + ["--expert-model-parallel-size", "2"])


def test_the_moe_matrix_has_both_outcomes():
    outcomes = {}
    for case in MOE_CASES:
        try:
            emit_megatron(build_moe(case), RUN)
            outcomes[case.name] = "emitted"
        except InfeasibleError:
            outcomes[case.name] = "refused"
    assert {name for name, outcome in outcomes.items() if outcome == "refused"} == set(REFUSALS)
    assert sum(outcome == "emitted" for outcome in outcomes.values()) >= 10


# ---- DeepSpeed 0.19.8: AutoEP (`expert_parallel`) ----------------------------------------------------
AUTOEP_CASES = ["mixtral-ep8-dp8-zero1", "mixtral-ep4-dp8-zero3", "deepseek-ep8-dp16-full", "gpt-moe-ep4-dp8-bias"]


@pytest.fixture(scope="module")
def deepspeed():
    return require("deepspeed")


def deepspeed_expert_groups(plan: Plan) -> dict[str, set[tuple[int, ...]]]:
    """DeepSpeed's own `_create_expert_and_data_parallel` (utils/groups.py, what AutoEP calls with
    mp_size = 1) run as each rank of the plan's world, its communication layer replaced by one that
    only records the groups: the ep and expert-data-parallel groups each rank ends up in."""
    from deepspeed.utils import groups

    layout, found = plan.layout, {"ep": set(), "edp": set()}
    for rank in range(layout.world_size):
        fake = mock.Mock(is_initialized=lambda: True, get_world_size=lambda group=None: layout.world_size,
                         get_rank=lambda group=None, rank=rank: rank, new_group=lambda ranks: tuple(ranks))
        with mock.patch.object(groups, "dist", fake), mock.patch.object(groups, "log_dist", lambda *a, **k: None), \
                mock.patch.object(groups, "_EXPERT_PARALLEL_GROUP", {}), \
                mock.patch.object(groups, "_EXPERT_DATA_PARALLEL_GROUP", {}), \
                mock.patch.object(groups, "_EXPERT_PARALLEL_GROUP_RANKS", {}), \
                mock.patch.object(groups, "_EXPERT_DATA_PARALLEL_GROUP_RANKS", {}):
            groups._create_expert_and_data_parallel(layout.ep, mp_size=1, pp_size=layout.pp)
            name = f"ep_size_{layout.ep}"
            found["ep"].add(tuple(groups._EXPERT_PARALLEL_GROUP[name]))
            found["edp"].add(tuple(groups._EXPERT_DATA_PARALLEL_GROUP[name]))
    return found


@pytest.mark.parametrize("name", AUTOEP_CASES)
def test_deepspeed_autoep_section_with_the_plans_ep_and_groups(deepspeed, name, monkeypatch):
    from deepspeed.module_inject.auto_ep_config import validate_autoep_config
    from deepspeed.runtime import config as ds_config_module
    from plan3d.emit.deepspeed import ds_config, refuse_moe

    plan = build_moe(next(c for c in MOE_CASES if c.name == name))
    layout = plan.layout
    refuse_moe(plan)  # nothing to refuse
    config = ds_config(plan)
    monkeypatch.setattr(ds_config_module.dist, "get_rank", lambda group=None: 0)  # rank 0 of the plan's world
    monkeypatch.setattr(ds_config_module.dist, "get_world_size", lambda group=None: layout.world_size)
    parsed = ds_config_module.DeepSpeedConfig(config)
    autoep = parsed.expert_parallel_config
    assert autoep.enabled and autoep.autoep_size == layout.ep and autoep.expert_tensor_parallel_size == 1
    validate_autoep_config(autoep, layout.world_size, layout.pp, 1, 1, zero_stage=layout.zero)
    assert parsed.zero_optimization_stage == layout.zero
    expected = {key: {tuple(g) for g in plan.rankmap.groups[key]} for key in ("ep", "edp")}
    assert deepspeed_expert_groups(plan) == expected


def test_deepspeed_refuses_expert_tensor_parallelism_as_autoep_does(deepspeed):
    from deepspeed.module_inject.auto_ep_config import parse_autoep_config, validate_autoep_config
    from plan3d.emit.deepspeed import refuse_moe

    plan = build_moe(next(c for c in MOE_CASES if c.name == "mixtral-tp2-ep4-dp4-sp"))
    with pytest.raises(InfeasibleError, match="keeps each expert whole"):
        refuse_moe(plan)
    layout = plan.layout  # what the plan needs: experts split over tp, i.e. expert tensor parallel = tp
    wanted = parse_autoep_config({"enabled": True, "autoep_size": layout.ep, "expert_tensor_parallel_size": layout.tp})
    with pytest.raises(ValueError, match="expert_tensor_parallel_size=2 is reserved"):
        validate_autoep_config(wanted, layout.world_size, 1, layout.tp, 1)


def test_deepspeed_refuses_a_capacity_factor_with_autoep(deepspeed):
    """AutoEP's config has no capacity factor: the key is not read."""
    from deepspeed.module_inject.auto_ep_config import parse_autoep_config
    from plan3d.emit.deepspeed import refuse_moe

    plan = build_moe(next(c for c in MOE_CASES if c.name == "mixtral-cf-ep2-dp8"))
    with pytest.raises(InfeasibleError, match="dropless"):
        refuse_moe(plan)
    parsed = parse_autoep_config({"enabled": True, "autoep_size": 2, "capacity_factor": 1.25})
    assert not any("capacity" in key for key in vars(parsed))


def test_emit_deepspeed_follows_the_profile_on_expert_parallelism(deepspeed):
    """emit deepspeed writes the AutoEP section: the deepspeed-0.19 profile runs ep > 1 (tp = 1)."""
    import json

    from plan3d.emit.deepspeed import PROFILE, emit_deepspeed
    from plan3d.specs.catalog import load_engine

    plan = build_moe(next(c for c in MOE_CASES if c.name == "mixtral-ep8-dp8-zero1"))
    assert load_engine(PROFILE).can_run.expert_parallel
    assert json.loads(emit_deepspeed(plan).text)["expert_parallel"] == {"enabled": True, "autoep_size": 8}


# ---- torchtitan 0.3.0: deepseek_v3 builder with expert_parallel_degree ------------------------------
TITAN_CASES = {
    "deepseek-ep8-dp16-zero3-full": ("deepseek", 2, dict(dp=16, ep=8, zero=3, recompute="full"), None),
    "deepseek-pp2-ep4-dp8-zero2": ("deepseek", 2, dict(pp=2, dp=8, ep=4, zero=2), None),
    "deepseek-cp2-ep4-dp4-zero3": ("deepseek", 1, dict(cp=2, dp=4, ep=4, zero=3), 8192),
    "deepseek-tp2-dp4-ep1-zero3-sp": ("deepseek", 1, dict(tp=2, dp=4, zero=3, sequence_parallel=True), None),
    "deepseek-noshared-ep2-dp8-zero3": ("deepseek-noshared", 1, dict(dp=8, ep=2, zero=3), None),
}
MODELS["deepseek-noshared"] = MODELS["deepseek"].model_copy(
    update={"name": "deepseek-noshared", "moe": MODELS["deepseek"].moe.model_copy(update={"shared_ffn_hidden": 0})})


def titan_plan(name: str) -> Plan:
    model, nodes, layout, seq = TITAN_CASES[name]
    return build_moe(MoECase(name, model, nodes, layout, seq_len=seq))


def titan_groups(config, world: int) -> dict[str, set[tuple[int, ...]]]:
    """torchtitan's own ParallelDims.build_mesh on torch's fake process group, once per rank: the
    ep and efsdp (expert FSDP) groups each rank is in."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from torchtitan.distributed.parallel_dims import ParallelDims

    assert not dist.is_initialized(), "another test left torch.distributed initialized"
    found = {"ep": set(), "efsdp": set()}
    for rank in range(world):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
        try:
            dims = ParallelDims.from_config(config.parallelism, world)
            dims.build_mesh()
            for name in found:
                found[name].add(tuple(dims.get_mesh(name).mesh.flatten().tolist()))
        finally:
            dist.destroy_process_group()
    return found


def check_titan_moe_model(plan: Plan, config) -> None:
    """The model torchtitan builds (on the meta device) has the plan's layers, experts and MLA and
    exactly plan3d's parameter count."""
    import torch
    from plan3d.cost.params import total_params

    model, moe, mla = plan.model, plan.model.moe, plan.model.mla
    model_config = config.model_spec.model
    model_config.update_from_config(config=config)  # as Trainer.__init__ (sharding, seq_len <= RoPE)
    layers = model_config.layers
    assert [layer.moe is not None for layer in layers] == [model.is_moe_layer(i) for i in range(model.layers)]
    routed = next(layer.moe for layer in layers if layer.moe is not None)
    assert (routed.num_experts, routed.router.top_k, routed.router.score_func) == (moe.experts, moe.top_k, moe.router)
    attention = layers[0].attention
    assert (attention.q_lora_rank or None, attention.kv_lora_rank) == (mla.q_lora_rank, mla.kv_lora_rank)
    assert (attention.qk_nope_head_dim, attention.qk_rope_head_dim, attention.v_head_dim) == (
        mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim)
    with torch.device("meta"):
        built = model_config.build()
    assert sum(p.numel() for p in built.parameters()) == total_params(model)


@pytest.mark.parametrize("name", list(TITAN_CASES))
def test_torchtitan_builds_the_moe_plan_with_its_expert_groups(name, titan, load_job):
    from plan3d.emit.torchtitan import emit_torchtitan

    plan = titan_plan(name)
    layout = plan.layout
    config = load_job(emit_torchtitan(plan).text, "job_" + name.replace("-", "_"))
    dims = titan["dims"].ParallelDims.from_config(config.parallelism, layout.world_size)
    assert (dims.tp, dims.pp, dims.cp, dims.ep, dims.dp_shard) == (layout.tp, layout.pp, layout.cp, layout.ep,
                                                                   layout.dp)
    check_batch(plan, config, dims)
    check_recompute(layout, config.activation_checkpoint, titan["ac"])
    check_titan_moe_model(plan, config)
    if layout.pp > 1:
        check_pipeline(plan, config, dims, titan)
    if layout.ep > 1:
        groups = titan_groups(config, layout.world_size)
        assert groups["ep"] == {tuple(g) for g in plan.rankmap.groups["ep"]}
        assert groups["efsdp"] == {tuple(g) for g in plan.rankmap.groups["edp"]}


def test_torchtitan_refusals_are_torchtitans(titan):
    """Mixtral-like (no MLA): torchtitan's llama3 builder has no experts. ep with tp: the expert
    weights' placement with EP on has no TP axis (experts whole). ep at ZeRO-0: the expert mesh
    efsdp = dp_shard * cp * tp / ep has no ranks when dp_shard is 1."""
    import inspect

    import spmd_types as spmd
    import torchtitan.models.llama3 as llama3
    from torchtitan.distributed.parallel_dims import MeshAxisName
    from torchtitan.models.common.moe_sharding import expert_param_placement_sparse
    from plan3d.emit.torchtitan import emit_torchtitan

    with pytest.raises(InfeasibleError, match="have MLA"):
        emit_torchtitan(build_moe(MoECase("m", "mixtral", 1, dict(dp=8, ep=8, zero=3))))
    assert not any("expert" in p or "moe" in p for p in inspect.signature(llama3._build_llama3_layers).parameters)
    tp_ep = build_moe(MoECase("x", "deepseek", 1, dict(tp=2, dp=4, ep=2, zero=3, sequence_parallel=True)))
    with pytest.raises(InfeasibleError, match="keeps each expert whole"):
        emit_torchtitan(tp_ep)
    axes = expert_param_placement_sparse().axis_types  # routed-expert weights with EP on
    assert axes[MeshAxisName.EP] == spmd.S(0) and MeshAxisName.TP not in axes
    zero0 = build_moe(MoECase("y", "deepseek", 1, dict(dp=8, ep=2, zero=0)))
    with pytest.raises(InfeasibleError, match="ep > 1 with ZeRO {2, 3} only"):
        emit_torchtitan(zero0)
    dims = titan["dims"].ParallelDims(dp_replicate=8, dp_shard=1, cp=1, tp=1, pp=1, ep=2, world_size=8)
    assert dims.dp_shard * dims.cp * dims.tp // dims.ep == 0  # build_mesh's efsdp: no expert-FSDP ranks
