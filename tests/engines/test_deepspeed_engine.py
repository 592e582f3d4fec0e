"""DeepSpeed 0.19's own code on every plan of the matrix: `plan3d emit deepspeed` parsed by
`deepspeed.runtime.config.DeepSpeedConfig` with the data-parallel world DeepSpeed would see, and
`deepspeed.initialize` on one CPU rank (gloo, world 1) for a representative subset.

The world DeepSpeedConfig divides the batch by (deepspeed 0.19.8, runtime/config.py `__init__`):
the mpu's `get_data_parallel_world_size()` when `deepspeed.initialize` has one (a PipelineModule
hands its PipelineParallelGrid: dp), else `dist.get_world_size()` (AutoTP passes no mpu: tp x dp).

Each case ends in one of two ways: emitted and parsed with the plan's values (micro-batch,
accumulation steps, global batch, ZeRO stage, bf16/fp16, accumulation dtype, AutoTP size), or
refused by plan3d with a reason that DeepSpeed's own code confirms (CONFIRM: a DeepSpeed call
that raises on the equivalent, or for AutoTP with a pipeline, the lines of DeepSpeed's source
that make it impossible, checked to still be there).
"""
from __future__ import annotations

import inspect
import json
import os
import socket

import pytest

from conftest import require
from plans import CASES, Case, build, case_ids
from plan3d.emit.deepspeed import PROFILE, emit_deepspeed
from plan3d.errors import InfeasibleError
from plan3d.plan import Plan

# Plans the matrix lacks: AutoTP without sequence parallelism at ZeRO-2/3 (the matrix's tp
# plans with ZeRO-2/3 all ask for sequence parallelism, which DeepSpeed refuses).
EXTRA = [
    Case("tp4-dp8-zero3-nosp", "llama3-8b", 4, dict(tp=4, dp=8, zero=3)),
    Case("tp2-dp16-zero2-nosp", "llama3-8b", 4, dict(tp=2, dp=16, zero=2, micro_batch=2), global_batch=128),
    Case("pp2-dp4-zero0-fp16", "llama3-8b", 1, dict(pp=2, dp=4, zero=0), precision="fp16"),
]
ALL = CASES + EXTRA
INITIALIZED = ["dp8-zero0", "dp8-zero1", "dp16-zero2", "dp32-zero3-full", "pp2-dp4-zero1", "tp1-pp2-dp4-fp32"]


@pytest.fixture(scope="module")
def ds():
    """deepspeed, with torch.distributed up on one CPU rank (gloo) as torchrun would set it."""
    deepspeed = require("deepspeed")
    import torch.distributed

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    started = not torch.distributed.is_initialized()
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    yield deepspeed
    if started and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


class DataParallelMpu:
    """What DeepSpeedConfig reads of an mpu: the data-parallel size (PipelineParallelGrid's
    get_data_parallel_world_size, runtime/pipe/topology.py)."""

    def __init__(self, dp: int):
        self.dp = dp

    def get_data_parallel_world_size(self) -> int:
        return self.dp


def parsed(ds, config: dict, plan: Plan, monkeypatch, mpu=None):
    """DeepSpeedConfig as deepspeed.initialize builds it for a rank of the plan's world."""
    from deepspeed.runtime import config as ds_config

    monkeypatch.setattr(ds_config.dist, "get_world_size", lambda group=None: plan.layout.world_size)
    return ds_config.DeepSpeedConfig(json.loads(json.dumps(config)), mpu)


def seen_mpu(plan: Plan):
    """The mpu deepspeed.initialize passes to DeepSpeedConfig: a pipeline's grid, or none."""
    return DataParallelMpu(plan.layout.dp) if plan.layout.pp > 1 else None


# ---- refusals, each confirmed by DeepSpeed's code --------------------------------------------------
def confirm_pipeline_zero(ds) -> str:
    """PipelineEngine asserts ZeRO < 2 (runtime/pipe/engine.py, PipelineEngine.__init__)."""
    with pytest.raises(AssertionError, match="incompatible with pipeline parallelism"):
        initialize(ds, tiny_config(zero=2, dtype="bf16", accum="fp32"), pipeline=True)
    return "deepspeed.initialize(PipelineModule, ZeRO-2) raises"


def confirm_no_sequence_parallel(ds) -> str:
    """AutoTP's config (runtime/tensor_parallel/config.py TPTrainingConfig) has no sequence-parallel key."""
    from deepspeed.runtime.tensor_parallel.config import get_tensor_parallel_config

    with pytest.raises(Exception, match="sequence_parallel"):
        get_tensor_parallel_config({"tensor_parallel": {"autotp_size": 2, "sequence_parallel": True}})
    return "TPTrainingConfig rejects sequence_parallel"


def confirm_no_stage_split(ds, split) -> str:
    """PipelineModule partitions 'uniform', 'parameters' or 'type:' only (runtime/pipe/module.py _partition_layers)."""
    from deepspeed.pipe import PipelineModule
    import torch

    with pytest.raises(NotImplementedError, match="Partitioning method"):
        PipelineModule([torch.nn.Linear(2, 2)] * 2, num_stages=1, partition_method=",".join(map(str, split)))
    return "PipelineModule(partition_method=<counts>) raises"


def confirm_autotp_has_no_pipeline_axis(ds, plan: Plan) -> str:
    """AutoTP's groups are a (data, tensor) mesh of the whole world with dp = world // tp
    (utils/groups.py _init_tp_mesh_device), and PipelineEngine asserts its engine dp equals its
    grid's dp (runtime/pipe/engine.py): with pp > 1, world // tp = pp x dp != dp."""
    from deepspeed.runtime.pipe.engine import PipelineEngine
    from deepspeed.runtime.pipe.topology import PipeDataParallelTopology
    from deepspeed.utils import groups

    mesh = inspect.getsource(groups._init_tp_mesh_device)
    assert "dist.get_world_size() // tensor_model_parallel_size" in mesh
    assert '("data_parallel", "tensor_parallel")' in mesh
    assert "self.dp_world_size == self.grid.data_parallel_size" in inspect.getsource(PipelineEngine.__init__)
    layout = plan.layout
    grid_dp = PipeDataParallelTopology(num_pp=layout.pp, num_dp=layout.dp).get_dim("data")
    assert layout.world_size // layout.tp != grid_dp
    return "source: AutoTP mesh dp = world // tp != pipeline grid dp"


def confirmation(ds, plan: Plan) -> str:
    """DeepSpeed's own refusal of one reason the layout cannot run (the most direct one available)."""
    layout = plan.layout
    if layout.pp > 1 and layout.zero >= 2:
        return confirm_pipeline_zero(ds)
    if layout.sequence_parallel:
        return confirm_no_sequence_parallel(ds)
    if layout.pp_layers is not None and len(set(layout.pp_layers)) > 1:
        return confirm_no_stage_split(ds, layout.pp_layers)
    if layout.tp > 1 and layout.pp > 1:
        return confirm_autotp_has_no_pipeline_axis(ds, plan)
    pytest.fail(f"no DeepSpeed confirmation for refusing {layout.short()}")


# ---- deepspeed.initialize on one CPU rank ------------------------------------------------------
def tiny_config(zero: int, dtype: str, accum: str, micro: int = 1, steps: int = 2, **zero_keys) -> dict:
    return {"train_batch_size": micro * steps, "train_micro_batch_size_per_gpu": micro,
            "gradient_accumulation_steps": steps, "zero_optimization": {"stage": zero, **zero_keys},
            "bf16": {"enabled": dtype == "bf16"}, "fp16": {"enabled": dtype == "fp16"},
            "data_types": {"grad_accum_dtype": accum}}


def at_world_one(config: dict) -> dict:
    """The emitted config for one rank: batch over one data-parallel rank, AutoTP off (world 1 has one tp rank)."""
    out = json.loads(json.dumps(config))
    out["train_batch_size"] = out["train_micro_batch_size_per_gpu"] * out["gradient_accumulation_steps"]
    out.pop("tensor_parallel", None)
    return out


def initialize(ds, config: dict, pipeline: bool = False):
    """deepspeed.initialize on a two-layer model (a one-stage PipelineModule for pipelines), torch AdamW."""
    import torch

    layers = [torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)]
    if pipeline:
        from deepspeed.pipe import PipelineModule

        model = PipelineModule(layers, num_stages=1, loss_fn=torch.nn.MSELoss(), partition_method="uniform")
    else:
        model = torch.nn.Sequential(*layers)
    config = {**config, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}
    engine, optimizer, _, _ = ds.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine, optimizer


# ---- the matrix ------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", ALL, ids=[c.name for c in ALL])
def test_config_class_takes_the_plan_or_deepspeed_confirms_the_refusal(ds, case, monkeypatch):
    plan = build(case)
    layout = plan.layout
    try:
        emitted = emit_deepspeed(plan)
    except InfeasibleError as err:
        assert PROFILE in str(err)
        assert confirmation(ds, plan)
        return
    config = json.loads(emitted.text)
    parsed_config = parsed(ds, config, plan, monkeypatch, seen_mpu(plan))
    steps = layout.micro_batches(plan.training.global_batch)
    assert parsed_config.train_micro_batch_size_per_gpu == layout.micro_batch
    assert parsed_config.gradient_accumulation_steps == steps
    assert layout.micro_batch * steps * layout.dp == plan.training.global_batch
    # AutoTP: DeepSpeed counts each sample once per tensor-parallel rank (no mpu: whole world)
    assert parsed_config.train_batch_size == plan.training.global_batch * layout.tp
    assert parsed_config.zero_optimization_stage == layout.zero
    assert parsed_config.bfloat16_config.enabled == (plan.training.precision in ("bf16", "fp8"))
    assert parsed_config.float16_config.enabled == (plan.training.precision == "fp16")
    assert parsed_config.tensor_parallel_config.autotp_size == (layout.tp if layout.tp > 1 else 0)
    fp32_accum = plan.grad_dtype == "fp32" and (layout.zero >= 1 or plan.training.precision == "fp32")
    assert (parsed_config.grad_accum_dtype in ("fp32", "float32")) == fp32_accum
    if layout.tp > 1:  # given a data-parallel mpu instead, the same config gives the plan's batch
        with_mpu = parsed(ds, config, plan, monkeypatch, DataParallelMpu(layout.dp))
        assert with_mpu.train_batch_size == plan.training.global_batch


@pytest.mark.parametrize("name", INITIALIZED)
def test_initialize_takes_the_dtype_zero_and_batch_keys_on_one_rank(ds, name):
    plan = build(next(c for c in CASES if c.name == name))
    config = at_world_one(json.loads(emit_deepspeed(plan).text))
    engine, optimizer = initialize(ds, config, pipeline=plan.layout.pp > 1)
    assert engine.zero_optimization_stage() == plan.layout.zero
    assert engine.train_micro_batch_size_per_gpu() == plan.layout.micro_batch
    assert engine.gradient_accumulation_steps() == plan.layout.micro_batches(plan.training.global_batch)
    import torch

    model_dtype, accum_dtype = engine.get_data_types()
    assert model_dtype == {"bf16": torch.bfloat16, "fp32": torch.float32}[plan.training.precision]
    keeps_fp32 = plan.layout.zero >= 1 or plan.training.precision == "fp32"
    assert accum_dtype == (torch.float32 if keeps_fp32 else model_dtype)


def test_initialize_refuses_fp32_accumulation_of_bf16_without_zero(ds):
    """Why ZeRO-0 gets bf16 accumulation: the issue's failure, reproduced (runtime/engine.py
    _do_optimizer_sanity_check)."""
    with pytest.raises(NotImplementedError, match="unsupported mix of model_dtype=torch.bfloat16"):
        initialize(ds, tiny_config(zero=0, dtype="bf16", accum="fp32"))
    plan = build(next(c for c in CASES if c.name == "dp8-zero0"))
    assert json.loads(emit_deepspeed(plan).text)["data_types"]["grad_accum_dtype"] == "bf16"
    assert any("ZeRO-1 to keep fp32 accumulation" in note for note in emit_deepspeed(plan).notes)


def test_refusal_confirmations_hold(ds):
    """Each confirmation raises only where DeepSpeed refuses: a pipeline at ZeRO-1 is taken, a
    tensor_parallel section without sequence_parallel parses, 'uniform' partitions."""
    from deepspeed.pipe import PipelineModule
    from deepspeed.runtime.tensor_parallel.config import get_tensor_parallel_config
    import torch

    engine, _ = initialize(ds, tiny_config(zero=1, dtype="bf16", accum="fp32"), pipeline=True)
    assert engine.zero_optimization_stage() == 1
    assert get_tensor_parallel_config({"tensor_parallel": {"autotp_size": 2}}).autotp_size == 2
    assert PipelineModule([torch.nn.Linear(2, 2)] * 2, num_stages=1, partition_method="uniform").parts == [0, 2]


def outcome(case: Case) -> str:
    try:
        emit_deepspeed(build(case))
        return "emitted"
    except InfeasibleError:
        return "refused"


def test_the_matrix_has_both_outcomes_and_extra_plans_are_emitted():
    """The matrix test is not vacuous: AutoTP, ZeRO 0-3 and pipelines are emitted, refusals happen."""
    outcomes = {case.name: outcome(case) for case in ALL}
    assert all(outcomes[c.name] == "emitted" for c in EXTRA)
    assert {"emitted", "refused"} == set(outcomes.values())
