"""torchtitan 0.3.x job (a config-function module): parsed back with `ast` and checked against the plan.

These tests need no torchtitan; tests/engines/test_torchtitan_engine.py loads the same files with
torchtitan's own ConfigManager and ParallelDims.
"""
from __future__ import annotations

import ast
import re

import pytest
from emit_helpers import make_plan

from plan3d.emit.torchtitan import emit_torchtitan
from plan3d.errors import InfeasibleError
from plan3d.specs.catalog import load_engine, load_model
from plan3d.specs.model import RopeScaling

# Llama 3.1 8B: Llama 3 8B's shapes with the llama3 RoPE scaling every torchtitan llama3 flavor has
LLAMA31_8B = load_model("llama3-8b").model_copy(update={"name": "llama3.1-8b",
                                                       "rope_scaling": RopeScaling(type="llama3", factor=8)})


def job_settings(text: str) -> dict:
    """What the emitted `plan3d_job()` sets: ParallelismConfig/CompileConfig keywords, training
    fields, the activation-checkpoint expression and the model_registry flavor (None: custom)."""
    tree = ast.parse(text)
    function = next(node for node in tree.body if isinstance(node, ast.FunctionDef))
    out = {"training": {}, "flavor": None}
    for node in ast.walk(function):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            if node.func.id in ("ParallelismConfig", "CompileConfig"):
                out[node.func.id] = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
            if node.func.id == "model_registry":
                out["flavor"] = ast.literal_eval(node.args[0])
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Attribute):
            target = ast.unparse(node.targets[0])
            if target.startswith("config.training."):
                out["training"][target.rsplit(".", 1)[1]] = ast.literal_eval(node.value)
            if target == "config.activation_checkpoint":
                out["ac"] = ast.unparse(node.value)
    return out


@pytest.mark.parametrize("tp,pp,dp,vpp,mb,zero,recompute,sp", [
    (2, 4, 4, 2, 1, 3, "full", True), (8, 1, 4, 1, 2, 2, "selective", True), (1, 1, 32, 1, 2, 0, "none", False),
    (4, 2, 4, 1, 1, 0, "none", False),
])
def test_torchtitan_values(tp, pp, dp, vpp, mb, zero, recompute, sp):
    plan = make_plan(LLAMA31_8B, tp=tp, pp=pp, dp=dp, vpp=vpp, micro_batch=mb, zero=zero, recompute=recompute,
                     sequence_parallel=sp)
    job = job_settings(emit_torchtitan(plan).text)
    par, train = job["ParallelismConfig"], job["training"]
    assert par["tensor_parallel_degree"] == tp and par["pipeline_parallel_degree"] == pp
    assert par["data_parallel_shard_degree"] * par["data_parallel_replicate_degree"] == dp
    assert (par["data_parallel_shard_degree"] == dp) == (zero >= 2)
    assert par["fsdp_reshard_after_forward"] == ("always" if zero == 3 else "never")
    assert par["enable_sequence_parallel"] is sp
    assert train["global_batch_size"] == 64 and train["seq_len"] == plan.model.seq_len
    assert job["ac"] == {"none": "None", "selective": "SelectiveAC.Config()", "full": "FullAC.Config()"}[recompute]
    assert job["flavor"] == "8B" and job["CompileConfig"] == {"enable": False}
    if pp > 1:
        assert par["pipeline_parallel_schedule"] == ("Interleaved1F1B" if vpp > 1 else "1F1B")
        parts = par["module_fqns_per_model_part"]
        assert len(parts) == pp * vpp and parts[0][0] == "tok_embeddings" and parts[-1][-2:] == ["norm", "lm_head"]
        assert [len([m for m in p if m.startswith("layers.")]) for p in parts] == [32 // (pp * vpp)] * (pp * vpp)
        assert train["local_batch_size"] * dp == 64 and par["pipeline_parallel_microbatch_size"] == mb
        assert train["disable_cuda_graphs"] is True
    else:
        assert train["local_batch_size"] == mb and "disable_cuda_graphs" not in train


def test_torchtitan_uneven_split_is_explicit_module_names():
    plan = make_plan(pp=4, dp=8, zero=3, pp_layers=(7, 9, 9, 7))
    parts = job_settings(emit_torchtitan(plan).text)["ParallelismConfig"]["module_fqns_per_model_part"]
    layer_ids = [[int(m.split(".")[1]) for m in part if m.startswith("layers.")] for part in parts]
    assert [len(ids) for ids in layer_ids] == [7, 9, 9, 7]
    assert [i for ids in layer_ids for i in ids] == list(range(32))  # every layer once, in order


def test_torchtitan_compile_follows_the_plan_engine_or_the_flag():
    plan = make_plan(tp=2, dp=16, zero=3, sequence_parallel=True)
    compiled = plan.model_copy(update={"engine": load_engine("torchtitan-compile")})
    assert job_settings(emit_torchtitan(compiled).text)["CompileConfig"] == {"enable": True}
    assert job_settings(emit_torchtitan(plan, compile=True).text)["CompileConfig"] == {"enable": True}
    assert job_settings(emit_torchtitan(compiled, compile=False).text)["CompileConfig"] == {"enable": False}


def test_torchtitan_flavor_only_for_the_rope_scaling_it_builds():
    """torchtitan's 8B flavor is Llama 3.1 (RoPE scaled by 8): Llama 3 (unscaled) and another
    factor build through the llama3 builder with the spec's RoPE."""
    unscaled = emit_torchtitan(make_plan(dp=32, zero=3))
    assert job_settings(unscaled.text)["flavor"] is None and 'scaling="none"' in unscaled.text
    assert job_settings(emit_torchtitan(make_plan(LLAMA31_8B, dp=32, zero=3)).text)["flavor"] == "8B"
    factor4 = LLAMA31_8B.model_copy(update={"rope_scaling": RopeScaling(type="llama3", factor=4)})
    emitted = emit_torchtitan(make_plan(factor4, dp=32, zero=3))
    assert job_settings(emitted.text)["flavor"] is None
    assert 'scaling="llama", scaling_factor=4.0, low_freq_factor=1.0, high_freq_factor=4.0' in emitted.text


@pytest.mark.parametrize("update, words", [
    ({"norm_eps": 1e-6}, "norm epsilon 1e-06 (it has 1e-05)"),
    ({"qk_norm": True}, "per-head q/k norms"),
    ({"rope_scaling": RopeScaling(type="yarn", factor=4)}, "rope scaling yarn (it has llama3)"),
])
def test_torchtitan_refuses_model_details_its_builder_cannot_set(update, words):
    plan = make_plan(LLAMA31_8B.model_copy(update=update), dp=32, zero=3)
    with pytest.raises(InfeasibleError, match=re.escape(words)):
        emit_torchtitan(plan)


def test_torchtitan_custom_llama_shapes_use_its_builder():
    plan = make_plan(pp=2, dp=16, zero=2)
    plan = plan.model_copy(update={"model": plan.model.model_copy(update={"name": "llama-28l", "layers": 28})})
    emitted = emit_torchtitan(plan)
    assert job_settings(emitted.text)["flavor"] is None and "n_layers=28" in emitted.text
    assert any("no registered torchtitan llama3 flavor" in note for note in emitted.notes)


@pytest.mark.parametrize("model,layout,precision,words", [
    ("llama3-8b", dict(dp=32, zero=1), "bf16", "ZeRO-1"),
    ("llama3-8b", dict(tp=2, pp=2, dp=8, zero=3, sequence_parallel=True, order="tp-cp-ep-pp-dp"), "bf16",
     "places ranks only"),
    ("llama3-8b", dict(dp=32, zero=3), "fp16", "bf16 or fp32"),
    ("gpt3-175b", dict(tp=8, dp=4, zero=3, sequence_parallel=True), "bf16", "torchtitan cannot build gpt3-175b: activation gelu"),
])
def test_torchtitan_refusals_say_what_to_change(model, layout, precision, words):
    with pytest.raises(InfeasibleError, match=words) as err:
        emit_torchtitan(make_plan(model=model, precision=precision, **layout))
    assert "0.3" in str(err.value)
