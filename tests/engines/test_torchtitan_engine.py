"""torchtitan 0.3.x's own code reads every emitted job (tests/engines/plans.py and a few more plans).

Each plan ends in one of two ways:
- emitted: the file is loaded exactly as `torchtitan.train` loads it (`ConfigManager().parse_args(
  ["--module", M, "--config", "plan3d_job"])`), `ParallelDims.from_config(parallelism, world_size)`
  validates the degrees (its `__post_init__`; only `build_mesh` needs a process group),
  `model_spec.model.update_from_config(config=...)` runs as in `Trainer.__init__`, the pipeline
  split goes through `_get_pipeline_metadata` and the stage-to-rank mapping, and the parsed values
  equal the plan's;
- refused by plan3d, and torchtitan's code confirms it cannot run the plan (each check names where).
No process group is created; the file is plain config, nothing is trained.
"""
from __future__ import annotations

import importlib
import inspect
import sys
from dataclasses import fields

import pytest
from conftest import require
from plans import CASES, build

from plan3d.emit.torchtitan import CONFIG_FUNCTION, emit_torchtitan
from plan3d.errors import InfeasibleError
from plan3d.layout import Layout
from plan3d.plan import Plan, build_plan
from plan3d.specs.catalog import load_cluster, load_engine, load_model
from plan3d.specs.training import TrainingSpec


def _plan(model, nodes: int, global_batch: int = 64, **layout) -> Plan:
    model = load_model(model) if isinstance(model, str) else model
    return build_plan(load_cluster("dgx-h100", nodes=nodes), model, TrainingSpec(global_batch=global_batch),
                      Layout(**layout))


def _custom_llama(layers: int, tied: bool = False, rope_theta: float = 500000.0):
    return load_model("llama3-8b").model_copy(update={"name": f"llama-{layers}l", "layers": layers,
                                                      "tied_embeddings": tied, "rope_theta": rope_theta})


# The matrix has ZeRO-1 on every interleaved and uneven plan (torchtitan has no ZeRO-1): these
# plans put vpp, uneven splits, 70B, a custom shape, ZeRO-3 with pp and the compile profile through.
EXTRA = {
    "tp2-pp2-dp2-vpp2-zero3": lambda: _plan("llama3-8b", 1, tp=2, pp=2, dp=2, vpp=2, zero=3,
                                            sequence_parallel=True),
    "tp2-pp4-dp4-uneven-zero2": lambda: _plan("llama3-8b", 4, tp=2, pp=4, dp=4, zero=2, sequence_parallel=True,
                                              pp_layers=(7, 9, 9, 7)),
    "tp8-pp4-dp4-llama70b-vpp5-zero3": lambda: _plan("llama3-70b", 16, 512, tp=8, pp=4, dp=4, vpp=5, zero=3,
                                                     sequence_parallel=True, recompute="selective"),
    "tp8-pp7-dp2-llama405b-zero3-bf16": lambda: _plan("llama3-405b", 14, 512, tp=8, pp=7, dp=2, zero=3,
                                                      sequence_parallel=True, recompute="full"),
    "tp2-pp4-dp1-zbv-zero2": lambda: _plan("llama3-8b", 1, tp=2, pp=4, vpp=2, schedule="zbv", zero=2,
                                           sequence_parallel=True),
    "pp4-dp2-dualpipev-uneven-zero3": lambda: _plan(_custom_llama(30), 1, pp=4, dp=2, vpp=2, schedule="dualpipev",
                                                    zero=3, pp_layers=(3, 4, 4, 4, 4, 4, 4, 3)),
    "pp2-dp4-zb1p-vpp3-zero0": lambda: _plan("llama3-8b", 1, pp=2, dp=4, vpp=3, schedule="zb1p", zero=0,
                                             pp_layers=(5, 5, 6, 6, 5, 5)),
    "tp8-cp2-dp4-llama8b-zero3": lambda: _plan("llama3-8b", 8, 64, tp=8, cp=2, dp=4, zero=3,
                                               sequence_parallel=True),
    "pp2-dp4-custom-28l-zero0": lambda: _plan(_custom_llama(28, rope_theta=10000.0), 1, pp=2, dp=4, zero=0,
                                              recompute="full"),
    "tp2-dp4-compile-zero3": lambda: _plan("llama3-8b", 1, tp=2, dp=4, zero=3, sequence_parallel=True).model_copy(
        update={"engine": load_engine("torchtitan-compile")}),
    "pp2-dp4-tied-refused": lambda: _plan(_custom_llama(32, tied=True), 1, pp=2, dp=4, zero=3),
    "tp8-dp4-gpt3-zero3-refused": lambda: _plan("gpt3-175b", 4, tp=8, dp=4, zero=3, sequence_parallel=True),
    "dp8-fp16-refused": lambda: build_plan(load_cluster("dgx-h100", nodes=1), load_model("llama3-8b"),
                                           TrainingSpec(global_batch=64, precision="fp16"), Layout(dp=8, zero=3)),
}

PLANS = [(case.name, lambda case=case: build(case)) for case in CASES] + list(EXTRA.items())


@pytest.fixture(scope="module")
def titan():
    """torchtitan's modules the checks call (skips, or fails under PLAN3D_REQUIRE_ENGINES=1, without it)."""
    require("torchtitan")
    names = {"config": "torchtitan.config", "dims": "torchtitan.distributed.parallel_dims",
             "pipeline": "torchtitan.distributed.pipeline_parallel", "fsdp": "torchtitan.distributed.fsdp",
             "ac": "torchtitan.distributed.activation_checkpoint", "configs": "torchtitan.config.configs",
             "schedules": "torch.distributed.pipelining.schedules"}
    return {key: importlib.import_module(module) for key, module in names.items()}


@pytest.fixture
def load_job(tmp_path, monkeypatch):
    """Write an emitted job as a module and load it the way torchtitan.train does."""
    monkeypatch.syspath_prepend(str(tmp_path))

    def load(text: str, module: str, *overrides: str):
        from torchtitan.config import ConfigManager

        (tmp_path / f"{module}.py").write_text(text)
        sys.modules.pop(module, None)
        return ConfigManager().parse_args(["--module", module, "--config", CONFIG_FUNCTION, *overrides])

    return load


@pytest.mark.parametrize("name,make", PLANS, ids=[name for name, _ in PLANS])
def test_torchtitan_reads_the_job_with_the_plans_values_or_confirms_the_refusal(name, make, titan, load_job):
    plan = make()
    try:
        emitted = emit_torchtitan(plan)
    except InfeasibleError as err:
        confirm_refusal(str(err), plan, titan, load_job)
        return
    module = "job_" + name.replace("-", "_")
    config = load_job(emitted.text, module)
    check_values(plan, config, titan)


def test_the_matrix_outcome(titan):
    """The per-case outcome the report lists: which matrix plans emit, which are refused and why."""
    outcome = {}
    for case in CASES:
        try:
            emit_torchtitan(build(case))
            outcome[case.name] = "emitted"
        except InfeasibleError as err:
            outcome[case.name] = "refused: " + str(err).split(": ", 1)[1]
    emitted = [name for name, result in outcome.items() if result == "emitted"]
    assert {"dp8-zero0", "tp4-dp2-nosp", "pp4-dp8-zero3"} <= set(emitted)
    assert all("ZeRO-1" in r or "places ranks" in r for r in outcome.values() if r != "emitted")


# ---- values -----------------------------------------------------------------------------------
def check_values(plan: Plan, config, titan) -> None:
    layout, model = plan.layout, plan.model
    par, training = config.parallelism, config.training
    dims = titan["dims"].ParallelDims.from_config(par, layout.world_size)  # asserts the product
    assert (dims.tp, dims.pp, dims.cp) == (layout.tp, layout.pp, layout.cp)
    assert dims.dp_replicate * dims.dp_shard == layout.dp
    assert dims.dp_shard == (layout.dp if layout.zero >= 2 else 1)
    resharded = titan["fsdp"].get_fsdp_reshard_after_forward_policy(par.fsdp_reshard_after_forward, dims.pp_enabled)
    assert resharded == (layout.zero == 3)
    assert par.enable_sequence_parallel == layout.sequence_parallel
    assert config.compile.enable == (plan.engine is not None and plan.engine.name == "torchtitan-compile")
    assert training.mixed_precision_param == ("float32" if plan.training.precision == "fp32" else "bfloat16")
    check_batch(plan, config, dims)
    check_recompute(layout, config.activation_checkpoint, titan["ac"])
    model_config = config.model_spec.model
    model_config.update_from_config(config=config)  # as Trainer.__init__: tp | heads, seq_len <= RoPE, tying
    check_model(model, model_config, training.seq_len)
    if layout.pp > 1:
        check_pipeline(plan, config, dims, titan)


def check_batch(plan: Plan, config, dims) -> None:
    """The batch arithmetic of torchtitan 0.3.0's Trainer.__init__ (trainer.py, 'verify batch sizes')."""
    layout, training, par = plan.layout, config.training, config.parallelism
    global_batch, local = training.global_batch_size, training.local_batch_size
    assert global_batch == plan.training.global_batch
    assert global_batch % (local * dims.dp_replicate * dims.dp_shard) == 0
    accumulation = global_batch // (local * layout.dp)
    pp_micro = local // par.pipeline_parallel_microbatch_size if dims.pp_enabled else 1
    assert accumulation * pp_micro == layout.micro_batches(plan.training.global_batch)
    assert (par.pipeline_parallel_microbatch_size if dims.pp_enabled else local) == layout.micro_batch
    assert training.seq_len == (plan.training.seq_len or plan.model.seq_len)
    # trainer.py: "Training sequence length ... must be divisible by" tp (with SP) * 2cp
    divisor = (dims.tp if par.enable_sequence_parallel else 1) * (2 * dims.cp if dims.cp > 1 else 1)
    assert training.seq_len % divisor == 0
    # Trainer.Config refuses CUDA graphs with pp; MoE jobs keep the deepseek_v3 recipe's disabled graphs
    assert training.disable_cuda_graphs == (dims.pp_enabled or plan.model.moe is not None)


def check_recompute(layout: Layout, ac_config, ac) -> None:
    expected = {"none": type(None), "selective": ac.SelectiveAC.Config, "full": ac.FullAC.Config}[layout.recompute]
    assert type(ac_config) is expected


def check_model(model, model_config, seq_len: int) -> None:
    layer = model_config.layers[0]
    attention = layer.attention
    assert len(model_config.layers) == model.layers
    assert (model_config.dim, model_config.vocab_size) == (model.hidden, model.vocab)
    assert (attention.n_heads, attention.n_kv_heads) == (model.heads, model.kv_heads_)
    assert layer.feed_forward.w1.out_features == model.ffn_hidden_
    assert model_config.enable_weight_tying == model.tied_embeddings
    assert attention.rope.theta == (model.rope_theta or 500000) and attention.rope.max_seq_len == seq_len
    assert type(attention.inner_attention).__qualname__ == "FlexAttention.Config"


def check_pipeline(plan: Plan, config, dims, titan) -> None:
    """torchtitan's split and schedule checks (distributed/pipeline_parallel.py) and the plan's split."""
    layout, par, pipeline = plan.layout, config.parallelism, titan["pipeline"]
    pipeline._get_pipeline_metadata(dims, par, config.model_spec.model)  # raises on a bad stage count
    schedule = titan["schedules"].get_schedule_class(par.pipeline_parallel_schedule)
    single = issubclass(schedule, titan["schedules"].PipelineScheduleSingle)
    assert single == (layout.vpp == 1)
    parts = par.module_fqns_per_model_part
    assert len(parts) == layout.pp * layout.vpp
    assert par.pipeline_parallel_schedule == {"1f1b": "1F1B", "interleaved-1f1b": "Interleaved1F1B",
                                              "zb1p": "InterleavedZeroBubble", "zbv": "ZBVZeroBubble",
                                              "dualpipev": "DualPipeV"}[layout.pipeline_schedule]
    for rank in range(layout.pp):  # loop (k*pp + r) or V (r, 2pp-1-r), as plan3d's cost model places stages
        stages = pipeline._get_pp_rank_to_stage_indices_mapping(rank, layout.pp, par.pipeline_parallel_schedule,
                                                                len(parts))
        assert tuple(stages) == tuple(s for s in range(len(parts)) if layout.rank_of_stage(s) == rank)
    counts = [sum(name.startswith("layers.") for name in part) for part in parts]
    assert tuple(counts) == layout.stage_layers(plan.model.layers)
    flat = [name for part in parts for name in part]
    assert flat == (["tok_embeddings"] + [f"layers.{i}" for i in range(plan.model.layers)] + ["norm", "lm_head"])
    micro = config.training.local_batch_size // par.pipeline_parallel_microbatch_size
    if single:  # torch's Schedule1F1B: "Number of microbatches ... must be greater than or equal to" stages
        assert micro >= layout.pp
    else:  # torch's ScheduleInterleaved1F1B: micro-batches a multiple of max(1, micro // pp) rounds
        assert micro % max(1, micro // layout.pp) == 0


# ---- refusals, confirmed by torchtitan's code ---------------------------------------------------
def confirm_refusal(message: str, plan: Plan, titan, load_job) -> None:
    confirmations = {"ZeRO-1": confirm_no_zero1, "places ranks only": confirm_fixed_mesh_order,
                     "bf16 or fp32": confirm_no_fp16, "tie embeddings": confirm_no_tying_with_pp,
                     "cannot build": confirm_llama_blocks_only}
    matched = [check for words, check in confirmations.items() if words in message]
    assert matched, f"a refusal no torchtitan check confirms: {message}"
    assert "0.3" in message
    for check in matched:
        check(plan, titan, load_job)


def confirm_no_zero1(plan, titan, load_job) -> None:
    """ZeRO-1 shards optimizer states with parameters and gradients whole. torchtitan 0.3.0's data
    parallelism is FSDP2 only: `data_parallel_shard_degree` shards parameters, gradients and
    optimizer states (fully_shard in distributed/fsdp.py), `data_parallel_replicate_degree` shards
    nothing, and neither the parallelism nor the optimizer config has a setting for sharded states."""
    configs = titan["configs"]
    data_parallel = {f.name for f in fields(configs.ParallelismConfig)
                     if "data_parallel" in f.name or "fsdp" in f.name or "zero" in f.name or "optim" in f.name}
    assert data_parallel == {"data_parallel_replicate_degree", "data_parallel_shard_degree",
                             "fsdp_reshard_after_forward", "enable_fsdp_symm_mem"}
    optimizer = importlib.import_module("torchtitan.components.optimizer.optimizer")
    assert not [f.name for f in fields(optimizer.OptimizersContainer.Config) if "shard" in f.name or "zero" in f.name]
    assert "fully_shard(" in inspect.getsource(titan["fsdp"].apply_fsdp_to_decoder)


def confirm_fixed_mesh_order(plan, titan, load_job) -> None:
    """ParallelDims.build_mesh unflattens the world as (pp, dp_replicate, dp_shard, cp, tp) and no
    config field changes that order."""
    source = inspect.getsource(titan["dims"].ParallelDims.build_mesh)
    assert '("pp", "dp_replicate", "dp_shard", "cp", "tp")' in source
    assert not [f.name for f in fields(titan["configs"].ParallelismConfig) if "order" in f.name or "mesh" in f.name]


def confirm_no_fp16(plan, titan, load_job) -> None:
    """The same job in bf16, with fp16 asked on torchtitan's command line: its parser refuses it."""
    bf16 = plan.model_copy(update={"training": plan.training.model_copy(update={"precision": "bf16"})})
    with pytest.raises(SystemExit):
        load_job(emit_torchtitan(bf16).text, "job_fp16", "--training.mixed_precision_param", "float16")


def confirm_no_tying_with_pp(plan, titan, load_job) -> None:
    """The same job without a pipeline, given pp=2: the model config refuses tied embeddings."""
    flat = plan.model_copy(update={"layout": plan.layout.model_copy(update={"pp": 1, "dp": plan.layout.dp * 2})})
    config = load_job(emit_torchtitan(flat).text, "job_tied", "--parallelism.pipeline_parallel_degree", "2",
                      "--training.disable_cuda_graphs")
    with pytest.raises(NotImplementedError, match="Weight tying is not supported with Pipeline Parallel"):
        config.model_spec.model.update_from_config(config=config)


def confirm_llama_blocks_only(plan, titan, load_job) -> None:
    """torchtitan 0.3.0's decoder block takes RMSNorm norms and a gated (SwiGLU: w1, w2, w3)
    feed-forward (models/common/decoder.py, feed_forward.py): no LayerNorm, GELU MLP or biases."""
    from torchtitan.models.common.decoder import TransformerBlock
    from torchtitan.models.common.feed_forward import FeedForward

    hints = {f.name: str(f.type) for f in fields(TransformerBlock.Config)}
    assert "RMSNorm" in hints["attention_norm"] and "RMSNorm" in hints["ffn_norm"]
    assert {"w1", "w2", "w3"} <= {f.name for f in fields(FeedForward.Config)}
    assert plan.model.norm != "rmsnorm" or plan.model.activation != "swiglu"
