"""Mixture-of-experts plans in the emitters (torch-free): Megatron's MoE and MLA flags, DeepSpeed's
AutoEP section, torchtitan's refusal, and every refusal's one-line error through the CLI.
The engines' own code checks the same plans in tests/engines/test_moe_engines.py."""
from __future__ import annotations

import json

import pytest

from emit_helpers import parse_megatron, run_cli
from plan3d.emit.deepspeed import ds_config, emit_deepspeed, refuse_moe
from plan3d.emit.megatron import emit_megatron
from plan3d.emit.megatron_moe import moe_layer_freq
from plan3d.emit.torchtitan import emit_torchtitan
from plan3d.errors import InfeasibleError
from plan3d.layout import Layout
from plan3d.plan import build_plan, save_plan
from plan3d.specs.catalog import load_cluster, load_engine
from plan3d.specs.model import MLASpec, ModelSpec, MoESpec
from plan3d.specs.training import TrainingSpec

LLAMA_PARTS = dict(activation="swiglu", norm="rmsnorm", bias=False, position="rope", vocab=32000, seq_len=4096)


def moe_model(layers=8, mla=None, bias=False, **moe) -> ModelSpec:
    parts = LLAMA_PARTS | {"bias": bias}
    return ModelSpec(name="moe-test", layers=layers, hidden=1024, heads=16, kv_heads=4, ffn_hidden=3584,
                     moe=MoESpec(**({"experts": 8, "top_k": 2} | moe)), mla=mla, **parts)


def moe_plan(model=None, nodes=1, gpu_cluster="dgx-h100", precision="bf16", **layout):
    return build_plan(load_cluster(gpu_cluster, nodes=nodes), model or moe_model(),
                      TrainingSpec(global_batch=64, precision=precision), Layout(**layout))


DEEPSEEK_MLA = MLASpec(q_lora_rank=None, kv_lora_rank=256, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64)


@pytest.mark.parametrize("layers,every,first_dense,expected", [
    (8, 1, 0, "1"), (8, 2, 0, "2"), (8, 1, 3, "([0]*3+[1]*5)"), (61, 1, 3, "([0]*3+[1]*58)"),
    (6, 2, 1, "([0]*2+[1]*1+[0]*1+[1]*1+[0]*1)"), (4, 2, 1, "([0]*2+[1]*1+[0]*1)"),
])
def test_layer_freq_is_megatrons_pattern_of_the_moe_layers(layers, every, first_dense, expected):
    model = moe_model(layers=layers, every=every, first_dense_layers=first_dense)
    text = moe_layer_freq(model)
    assert text == expected
    if text.isdigit():  # Megatron's integer rule: layer i is MoE when i % N == 0
        pattern = [int(i % int(text) == 0) for i in range(layers)]
    else:
        pattern = eval(text)  # the list expression Megatron's moe_freq_type evaluates
    assert pattern == [int(model.is_moe_layer(i)) for i in range(layers)]


def test_megatron_moe_flags_carry_the_spec():
    model = moe_model(expert_ffn_hidden=512, shared_ffn_hidden=1024, shared_expert_gate=True, router="sigmoid",
                      capacity_factor=1.5, first_dense_layers=1)
    args = parse_megatron(emit_megatron(moe_plan(model, tp=2, dp=4, ep=4, zero=1, sequence_parallel=True)).text)
    assert (args["--num-experts"], args["--moe-router-topk"], args["--moe-ffn-hidden-size"]) == ("8", "2", "512")
    assert args["--moe-layer-freq"] == "([0]*1+[1]*7)"
    assert (args["--expert-model-parallel-size"], args["--expert-tensor-parallel-size"]) == ("4", "2")
    assert args["--moe-shared-expert-intermediate-size"] == "1024"
    assert "--moe-shared-expert-gate" in args and "--moe-shared-expert-overlap" in args
    assert args["--moe-router-score-function"] == "sigmoid" and "--moe-router-enable-expert-bias" in args
    assert args["--moe-router-load-balancing-type"] == "seq_aux_loss"
    assert args["--moe-expert-capacity-factor"] == "1.5" and "--moe-pad-expert-input-to-capacity" in args
    assert args["--moe-token-dispatcher-type"] == "alltoall" and "--moe-grouped-gemm" in args


def test_megatron_dropless_softmax_without_shared_experts():
    args = parse_megatron(emit_megatron(moe_plan(dp=8, ep=8, zero=1)).text)
    assert args["--moe-layer-freq"] == "1" and args["--moe-router-load-balancing-type"] == "aux_loss"
    for absent in ("--moe-expert-capacity-factor", "--moe-shared-expert-intermediate-size",
                   "--moe-router-enable-expert-bias", "--multi-latent-attention"):
        assert absent not in args
    assert args["--num-query-groups"] == "4"


def test_megatron_mla_flags_replace_gqa():
    args = parse_megatron(emit_megatron(moe_plan(moe_model(mla=DEEPSEEK_MLA), dp=8, ep=2, zero=1)).text)
    assert "--multi-latent-attention" in args and "--q-lora-rank" not in args  # None: full-rank queries
    assert (args["--kv-lora-rank"], args["--qk-head-dim"], args["--qk-pos-emb-head-dim"], args["--v-head-dim"]) == (
        "256", "64", "32", "64")
    assert args["--rope-type"] == "rope"
    assert "--group-query-attention" not in args and "--kv-channels" not in args


def test_megatron_leaves_grouped_gemm_off_before_ampere():
    """validate_args asserts compute capability >= 8 with --moe-grouped-gemm; a V100 is 7."""
    emitted = emit_megatron(moe_plan(gpu_cluster="dgx-2", precision="fp16", dp=16, ep=2, zero=1))
    assert "--moe-grouped-gemm" not in parse_megatron(emitted.text)
    assert any("--moe-grouped-gemm is off" in note for note in emitted.notes)


@pytest.mark.parametrize("model,layout,reason", [
    (moe_model(), dict(dp=16, ep=16, zero=1), "does not divide the 8 experts"),
    (moe_model(), dict(tp=2, dp=4, ep=2, zero=1), "set sequence_parallel"),
    (moe_model(bias=True), dict(tp=2, dp=4, ep=2, zero=1, sequence_parallel=True), "experts with biases"),
    (moe_model(), dict(tp=2, pp=2, dp=4, ep=2, zero=1, sequence_parallel=True, order="tp-cp-ep-pp-dp"),
     "tp-cp-ep-pp-dp with pp > 1"),
    (moe_model(mla=DEEPSEEK_MLA).model_copy(update={"position": "learned"}), dict(dp=8, zero=1), "set position rope"),
])
def test_megatron_refuses_what_megatron_refuses(model, layout, reason):
    nodes = 2 if Layout(**layout).world_size > 8 else 1
    with pytest.raises(InfeasibleError, match=reason) as err:
        emit_megatron(moe_plan(model, nodes=nodes, **layout))
    assert "megatron-core 0.17-0.19" in str(err.value) and "\n" not in str(err.value)


def test_megatron_accepts_the_pp_dp_order_when_ep_equals_cp():
    plan = moe_plan(nodes=2, tp=2, cp=2, pp=2, dp=2, ep=2, zero=1, sequence_parallel=True, order="tp-cp-ep-pp-dp")
    assert "--use-tp-pp-dp-mapping" in parse_megatron(emit_megatron(plan).text)


def test_deepspeed_autoep_section_and_refusals():
    plan = moe_plan(dp=8, ep=4, zero=2)
    refuse_moe(plan)
    assert ds_config(plan)["expert_parallel"] == {"enabled": True, "autoep_size": 4}
    assert "expert_parallel" not in ds_config(moe_plan(dp=8, zero=2))
    with pytest.raises(InfeasibleError, match="keeps each expert whole"):
        refuse_moe(moe_plan(tp=2, dp=4, ep=2, zero=1))
    with pytest.raises(InfeasibleError, match="dropless"):
        refuse_moe(moe_plan(moe_model(capacity_factor=1.25), dp=8, ep=2, zero=1))
    ep1 = emit_deepspeed(moe_plan(moe_model(capacity_factor=1.25), dp=8, zero=1))
    assert "expert_parallel" not in json.loads(ep1.text)
    assert any("capacity_factor=1.25 is not a DeepSpeed setting" in note for note in ep1.notes)


def test_emit_deepspeed_ep_follows_the_profile():
    plan = moe_plan(dp=8, ep=4, zero=2)
    if getattr(load_engine("deepspeed-0.19").can_run, "expert_parallel", False):
        assert json.loads(emit_deepspeed(plan).text)["expert_parallel"]["autoep_size"] == 4
    else:
        with pytest.raises(InfeasibleError, match="expert parallelism"):
            emit_deepspeed(plan)


def deepseek_like(**moe) -> ModelSpec:
    return moe_model(layers=6, mla=DEEPSEEK_MLA, **({"experts": 16, "top_k": 4, "expert_ffn_hidden": 512,
                                                   "shared_ffn_hidden": 1024, "first_dense_layers": 1,
                                                   "router": "sigmoid"} | moe))


def test_torchtitan_builds_a_deepseek_shaped_moe_with_expert_parallelism():
    text = emit_torchtitan(moe_plan(deepseek_like(), nodes=2, dp=16, ep=8, zero=3)).text
    assert "deepseek_v3._build_dsv3_layers(" in text and "expert_parallel_degree=8," in text
    for value in ("n_dense_layers=1", "num_experts=16", "num_shared_experts=2", "moe_hidden_dim=512",
                  "router_top_k=4", 'router_score_func="sigmoid"', "q_lora_rank=0", "kv_lora_rank=256",
                  'scaling="none"'):
        assert value in text
    compile(text, "plan3d_job.py", "exec")  # valid Python


@pytest.mark.parametrize("model,layout,names", [
    (moe_model(), dict(dp=8, zero=3), ["have MLA", "emit megatron"]),
    (deepseek_like(), dict(tp=2, dp=4, ep=2, zero=3, sequence_parallel=True), ["keeps each expert whole", "tp=1"]),
    (deepseek_like(), dict(dp=8, ep=2, zero=0), ["ep > 1 with ZeRO {2, 3} only"]),
    (deepseek_like(every=2), dict(dp=8, zero=3), ["one every 2"]),
    (deepseek_like(shared_ffn_hidden=700), dict(dp=8, zero=3), ["whole routed-expert widths"]),
    (deepseek_like(capacity_factor=1.0), dict(dp=8, zero=3), ["dropless"]),
])
def test_torchtitan_refuses_moe_naming_what_is_missing(model, layout, names):
    with pytest.raises(InfeasibleError) as err:
        emit_torchtitan(moe_plan(model, **layout))
    message = str(err.value)
    assert all(name in message for name in names) and "\n" not in message


@pytest.mark.parametrize("engine", ["megatron", "deepspeed", "torchtitan"])
def test_cli_refusal_is_one_line_and_exit_one(tmp_path, capsys, engine):
    plan = moe_plan(tp=2, dp=4, ep=2, zero=1)  # no sequence parallelism, experts over tp
    path = tmp_path / "plan.json"
    save_plan(plan, path)
    code = run_cli(["emit", engine, str(path)])
    err = capsys.readouterr().err.strip()
    assert code == 1 and len(err.splitlines()) == 1 and "Traceback" not in err
