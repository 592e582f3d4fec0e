"""FP8 plans through the engines' own code (the engines tier).

Megatron-Core 0.19.2: the emitted `--bf16 --fp8-format hybrid --fp8-recipe delayed` block goes
through `parse_args` + `validate_args` (arch patched to the plan's GPU, Hopper) and
`TransformerConfig`, which must hold fp8 "hybrid" with the delayed recipe and the plan's values.
torchtitan 0.3.0: the emitted config function is loaded by its ConfigManager, with the float8
converter built by torchtitan's own `Float8LinearConverter` and applied by its own
`model_registry` / `convert` (torchao, which is not in the CPU tier, stands in through a
minimal `Float8LinearConfig` and `Float8Linear`; the GPU capability check is patched to the plan's
GPU). A100: plan3d refuses, and torchtitan's converter refuses the same GPU generation (SM 8.0
< 8.9). DeepSpeed 0.19.8: plan3d refuses fp8, and DeepSpeedConfig has no fp8 setting to hold it.
"""
from __future__ import annotations

import dataclasses
import json
import sys
import types
from unittest import mock

import pytest

from conftest import require
from plans import Case, build
from test_deepspeed_engine import ds, parsed  # noqa: F401 (ds: the fixture, torch.distributed up on gloo)
from test_megatron_engine import RUN, assert_values_match, shell_parts, transformer_config, validated
from plan3d.emit.deepspeed import emit_deepspeed
from plan3d.emit.megatron import emit_megatron, gpu_arch
from plan3d.emit.torchtitan import CONFIG_FUNCTION, emit_torchtitan
from plan3d.errors import InfeasibleError, SpecError
from plan3d.layout import Layout
from plan3d.plan import build_plan
from plan3d.specs.catalog import load_cluster, load_model
from plan3d.specs.training import TrainingSpec

FP8_CASES = [
    Case("fp8-tp2-dp4-sp", "llama3-8b", 1, dict(tp=2, dp=4, zero=1, sequence_parallel=True), precision="fp8"),
    Case("fp8-tp2-pp2-dp2-vpp2", "llama3-8b", 1, dict(tp=2, pp=2, dp=2, vpp=2, zero=1, sequence_parallel=True),
         precision="fp8"),
    Case("fp8-tp8-pp4-dp4-llama70b", "llama3-70b", 16, dict(tp=8, pp=4, dp=4, vpp=5, zero=1,
                                                             sequence_parallel=True), global_batch=512,
         precision="fp8"),
    Case("fp8-tp8-pp16-gpt3-selective", "gpt3-175b", 64, dict(tp=8, pp=16, dp=4, zero=1, sequence_parallel=True,
                                                               recompute="selective"), global_batch=1536,
         precision="fp8"),
]
TITAN_CASES = [  # torchtitan builds llama only and has no ZeRO-1
    Case("fp8-tp2-dp4-zero2", "llama3-8b", 1, dict(tp=2, dp=4, zero=2, sequence_parallel=True), precision="fp8"),
    Case("fp8-tp8-pp4-dp4-zero3-llama70b", "llama3-70b", 16, dict(tp=8, pp=4, dp=4, zero=3, sequence_parallel=True),
         global_batch=512, precision="fp8"),
    Case("fp8-tp2-dp4-custom-shape", "llama3-8b", 1, dict(tp=2, dp=4, zero=3, sequence_parallel=True),
         precision="fp8", seq_len=4096),
]
DEEPSPEED_CASE = Case("fp8-dp8-zero1", "llama3-8b", 1, dict(dp=8, zero=1), precision="fp8")


def a100_fp8_plan():
    return build_plan(load_cluster("dgx-a100-80g", nodes=1), load_model("llama3-8b"),
                      TrainingSpec(global_batch=64, precision="fp8"), Layout(tp=2, dp=4, zero=2))


@pytest.fixture(scope="module")
def megatron():
    return require("megatron.training.arguments")


@pytest.mark.parametrize("case", FP8_CASES, ids=[c.name for c in FP8_CASES])
def test_megatron_reads_fp8_hybrid_delayed_with_the_plans_values(megatron, case):
    plan = build(case)
    env, _, argv = shell_parts(emit_megatron(plan, RUN).text)
    args = validated(megatron, argv, plan.layout.world_size, gpu_arch(plan), env)
    config = transformer_config(args)
    assert (args.fp8, args.fp8_recipe, args.bf16) == ("hybrid", "delayed", True)
    assert (config.fp8, config.fp8_recipe) == ("hybrid", "delayed")
    assert not config.first_last_layers_bf16  # every transformer layer in FP8, as the time model has it
    assert_values_match(args, config, plan)


@pytest.mark.parametrize("recompute", ["moe-act", "moe"])
def test_megatron_takes_moe_module_recompute_with_fp8_under_the_tensorwise_recipe(megatron, recompute):
    """Megatron's TransformerConfig refuses moe_act / layernorm recompute under delayed scaling; the
    emitted tensorwise recipe is what it takes (it then asks Transformer Engine >= 2.6, which the CPU
    tier does not have: its own version check is the refusal left)."""
    from plan3d.specs.model import MoESpec

    model = load_model("llama3-8b").model_copy(update={"moe": MoESpec(experts=8, top_k=2)})
    plan = build_plan(load_cluster("dgx-h100", nodes=1), model, TrainingSpec(global_batch=64, precision="fp8"),
                      Layout(tp=2, dp=4, ep=4, zero=1, sequence_parallel=True, recompute=recompute))
    env, _, argv = shell_parts(emit_megatron(plan, RUN).text)
    args = validated(megatron, argv, plan.layout.world_size, gpu_arch(plan), env)
    assert (args.fp8, args.fp8_recipe) == ("hybrid", "tensorwise")
    with pytest.raises(ValueError, match="transformer-engine>=2.6"):
        transformer_config(args)
    args.fp8_recipe = "delayed"  # what plan3d emitted before: Megatron's own refusal
    with pytest.raises(ValueError, match="Delayed scaling does not support moe_act and layernorm recompute"):
        transformer_config(args)


def test_megatron_refuses_a_recipe_it_does_not_have(megatron):
    """The recipe flag is Megatron's own choice list: a misspelt one would not pass (argparse exits)."""
    plan = build(FP8_CASES[0])
    env, _, argv = shell_parts(emit_megatron(plan, RUN).text)
    argv[argv.index("--fp8-recipe") + 1] = "delayed-scaling"
    with pytest.raises(SystemExit):
        validated(megatron, argv, plan.layout.world_size, gpu_arch(plan), env)


def test_fp8_on_a100_is_refused_by_every_emitter():
    plan = a100_fp8_plan()
    for emit in (lambda p: emit_megatron(p, RUN), emit_torchtitan):
        with pytest.raises(SpecError, match="a100-80gb: has no FP8 tensor cores"):
            emit(plan)


@pytest.fixture
def titan_float8(monkeypatch):
    """torchtitan's float8 module with torchao's two pieces stood in (torchao is not in the CPU tier)
    and its GPU check answering for `capability`; returns a setter for the capability."""
    float8 = require("torchtitan.components.quantization.float8")
    from torchtitan.models.common.linear import Linear

    @dataclasses.dataclass(kw_only=True, slots=True)
    class StandInConfig(Linear.Config):
        _torchao_config: object = None

    stand_in = types.SimpleNamespace(Config=StandInConfig)
    torchao_float8 = types.ModuleType("torchao.float8")
    torchao_float8.Float8LinearConfig = types.SimpleNamespace(from_recipe_name=lambda name: ("recipe", name))
    monkeypatch.setitem(sys.modules, "torchao", types.ModuleType("torchao"))
    monkeypatch.setitem(sys.modules, "torchao.float8", torchao_float8)
    monkeypatch.setattr(float8, "Float8Linear", stand_in)
    capability = {"sm": (9, 0)}
    monkeypatch.setattr(float8, "has_cuda_capability", lambda major, minor: capability["sm"] >= (major, minor))
    monkeypatch.setattr(float8, "has_rocm_capability", lambda major, minor: False)
    return types.SimpleNamespace(module=float8, linear=Linear, stand_in=StandInConfig, capability=capability)


def load_job(tmp_path, monkeypatch, text: str, module: str):
    from torchtitan.config import ConfigManager

    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / f"{module}.py").write_text(text)
    sys.modules.pop(module, None)
    return ConfigManager().parse_args(["--module", module, "--config", CONFIG_FUNCTION])


@pytest.mark.parametrize("case", TITAN_CASES, ids=[c.name for c in TITAN_CASES])
def test_torchtitan_swaps_the_layer_linears_to_float8_and_keeps_the_head(case, titan_float8, tmp_path, monkeypatch):
    plan = build(case)
    config = load_job(tmp_path, monkeypatch, emit_torchtitan(plan).text, "job_" + case.name.replace("-", "_"))
    converted = [fqn for fqn, linear, _, _ in config.model_spec.model.traverse(titan_float8.linear.Config)
                 if isinstance(linear, titan_float8.stand_in)]
    kept = [fqn for fqn, linear, _, _ in config.model_spec.model.traverse(titan_float8.linear.Config)
            if not isinstance(linear, titan_float8.stand_in)]
    assert kept == ["lm_head"]
    assert len(converted) == 5 * plan.model.layers  # per layer: fused wqkv, wo, w1, w2, w3 (fuse_qkv=True)
    assert all(fqn.startswith("layers.") for fqn in converted)


def test_torchtitan_converter_refuses_the_a100_as_plan3d_does(titan_float8):
    """torchtitan's own converter refuses SM 8.0 (A100): the refusal plan3d gives before emitting."""
    titan_float8.capability["sm"] = (8, 0)
    converter = titan_float8.module.Float8LinearConverter.Config(filter_fqns=["lm_head"])
    with pytest.raises(ValueError, match="SM89 or later"):
        converter.build()
    with pytest.raises(SpecError):
        emit_torchtitan(a100_fp8_plan())


def test_deepspeed_refuses_fp8_and_its_config_has_no_fp8_setting(ds, monkeypatch):
    plan = build(DEEPSPEED_CASE)
    with pytest.raises(InfeasibleError, match="no FP8 training"):
        emit_deepspeed(plan)
    bf16_plan = plan.model_copy(update={"training": plan.training.model_copy(update={"precision": "bf16"})})
    config = dict(json.loads(emit_deepspeed(bf16_plan).text), fp8={"enabled": True})
    ds_config = parsed(ds, config, plan, monkeypatch)
    assert not [name for name in vars(ds_config) if "fp8" in name.lower()]  # the key is read by nothing
    assert ds_config.bfloat16_config.enabled  # it trains in bf16 whatever the fp8 key says
