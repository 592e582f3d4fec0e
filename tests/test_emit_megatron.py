"""Megatron-LM arguments: parsed back and checked against the plan."""
from __future__ import annotations


import pytest

from script_helpers import SENTINEL, run_script  # noqa: E402
from emit_helpers import make_plan, parse_megatron, run_cli
from plan3d.emit.megatron import MegatronRun, emit_megatron, pipeline_layout
from plan3d.errors import InfeasibleError
from plan3d.plan import save_plan


@pytest.mark.parametrize("tp,pp,dp,vpp,mb,zero,sp,recompute", [
    (8, 4, 1, 2, 1, 1, True, "selective"),
    (4, 2, 4, 1, 2, 0, False, "full"),
    (2, 1, 16, 1, 4, 1, True, "none"),
])
def test_megatron_values(tp, pp, dp, vpp, mb, zero, sp, recompute):
    plan = make_plan(tp=tp, pp=pp, dp=dp, vpp=vpp, micro_batch=mb, zero=zero, sequence_parallel=sp,
                     recompute=recompute)
    args = parse_megatron(emit_megatron(plan).text)
    assert int(args["--tensor-model-parallel-size"]) == tp
    assert int(args["--pipeline-model-parallel-size"]) == pp
    assert int(args["--micro-batch-size"]) == mb
    assert int(args["--global-batch-size"]) == plan.training.global_batch
    assert ("--sequence-parallel" in args) == sp
    assert ("--use-distributed-optimizer" in args) == (zero == 1)
    assert args.get("--recompute-granularity", "none") == recompute
    if vpp > 1:
        assert int(args["--num-virtual-stages-per-pipeline-rank"]) == vpp
    assert "--use-tp-pp-dp-mapping" not in args
    assert "--overlap-grad-reduce" in args  # the profile's grad_reduce: overlapped
    assert ("--overlap-param-gather" in args) == (zero >= 1)  # validate_args: needs the distributed optimizer
    assert ("--tp-comm-overlap" in args) == sp  # validate_args: needs sequence parallelism
    assert int(args["--num-layers"]) == plan.model.layers
    assert int(args["--num-query-groups"]) == plan.model.kv_heads_
    assert args["--normalization"] == "RMSNorm" and "--swiglu" in args and "--bf16" in args
    assert args["--rotary-base"] == "500000"  # llama3-8b's rope_theta


def test_megatron_pp_dp_order_and_uneven_split():
    plan = make_plan(tp=2, pp=4, dp=4, order="tp-cp-ep-pp-dp", pp_layers=(7, 9, 9, 7))
    args = parse_megatron(emit_megatron(plan).text)
    assert "--use-tp-pp-dp-mapping" in args
    assert (args["--decoder-first-pipeline-num-layers"], args["--decoder-last-pipeline-num-layers"]) == ("7", "7")
    assert "--pipeline-model-parallel-layout" not in args


def test_pipeline_layout_any_split_with_virtual_stages():
    assert pipeline_layout((3, 5, 4, 4)) == "Et*3|t*5|t*4|t*4L"
    plan = make_plan(pp=2, dp=4, vpp=2, pp_layers=(7, 9, 8, 8))  # middle stages differ, interleaved
    args = parse_megatron(emit_megatron(plan).text)
    assert args["--pipeline-model-parallel-layout"] == "Et*7|t*9|t*8|t*8L"
    assert "--num-virtual-stages-per-pipeline-rank" not in args  # the layout states vpp (4 stages / pp 2)
    middle = parse_megatron(emit_megatron(make_plan(pp=4, dp=8, pp_layers=(7, 9, 8, 8))).text)
    assert middle["--pipeline-model-parallel-layout"] == "Et*7|t*9|t*8|t*8L"
    assert "--decoder-first-pipeline-num-layers" not in middle


@pytest.mark.parametrize("zero,strategy", [(2, "optim_grads"), (3, "optim_grads_params")])
def test_megatron_zero2_and_3_are_megatron_fsdp(zero, strategy):
    emitted = emit_megatron(make_plan(tp=4, dp=8, zero=zero, sequence_parallel=True))
    args = parse_megatron(emitted.text)
    assert "--use-megatron-fsdp" in args and args["--data-parallel-sharding-strategy"] == strategy
    assert args["--ckpt-format"] == "fsdp_dtensor" and "--overlap-param-gather" in args
    assert "unset CUDA_DEVICE_MAX_CONNECTIONS" in emitted.text
    assert "export CUDA_DEVICE_MAX_CONNECTIONS" not in emitted.text


@pytest.mark.parametrize("layout,needle", [
    ({"tp": 2, "pp": 4, "dp": 4, "zero": 3}, "ZeRO-3 with pipeline parallelism"),
    ({"tp": 2, "pp": 2, "dp": 8, "order": "dp-tp-cp-ep-pp"}, "places ranks only as"),
])
def test_megatron_refuses_what_it_cannot_run(layout, needle):
    with pytest.raises(InfeasibleError, match=needle) as refusal:
        emit_megatron(make_plan(**layout))
    assert "0.17-0.19" in str(refusal.value)  # names the release range


def test_megatron_zero2_with_pipelining_is_emitted_as_estimate_reads_it():
    """A "ZeRO-2" Megatron layout with pp > 1 is the distributed optimizer (the profile's
    zero_read_as_with_pp), for emit as for estimate and check: ZeRO-1 arguments and the note."""
    emitted = emit_megatron(make_plan(tp=1, pp=4, dp=8, zero=2))
    args = parse_megatron(emitted.text)
    assert "--use-distributed-optimizer" in args and "--use-megatron-fsdp" not in args
    assert any("ZeRO-2 with pp > 1 read as megatron-core's distributed optimizer" in n for n in emitted.notes)


def test_megatron_refuses_a_rope_base_its_integer_flag_cannot_take():
    plan = make_plan(tp=2, dp=16)
    plan = plan.model_copy(update={"model": plan.model.model_copy(update={"rope_theta": 1e4 + 0.5})})
    with pytest.raises(InfeasibleError, match="integer --rotary-base"):
        emit_megatron(plan)


def test_megatron_rotary_base_defaults_to_megatrons():
    plan = make_plan(model="gpt-neox-20b", tp=4, dp=8, global_batch=64)  # rope, no rope_theta in its spec
    assert parse_megatron(emit_megatron(plan).text)["--rotary-base"] == "10000"
    gpt3 = parse_megatron(emit_megatron(make_plan(model="gpt3-175b", tp=8, pp=4)).text)
    assert gpt3["--position-embedding-type"] == "learned_absolute" and "--rotary-base" not in gpt3


@pytest.mark.parametrize("layout,value", [
    ({"tp": 2, "dp": 16, "zero": 1}, "1"),  # exported before Blackwell
    ({"tp": 1, "dp": 32, "zero": 1}, SENTINEL),  # left as the environment has it
])
def test_megatron_max_connections_for_tensor_parallelism(layout, value):
    run = run_script(emit_megatron(make_plan(**layout)).text)
    assert run.returncode == 0, run.stderr
    assert run.env["CUDA_DEVICE_MAX_CONNECTIONS"] == value


def test_megatron_run_arguments_become_script_defaults():
    plan = make_plan(tp=2, dp=16)
    bare = run_script(emit_megatron(plan).text, fill_required=False)
    assert bare.returncode != 0 and bare.argv == [] and "set MEGATRON_LM " in bare.stderr
    run = MegatronRun(data_path="/data/web_text_document", tokenizer="meta-llama/Meta-Llama-3-8B",
                      train_iters=500, lr=3e-4)
    text = emit_megatron(plan, run).text
    args = parse_megatron(text)
    assert (args["--train-iters"], args["--lr"], args["--data-path"]) == ("500", "0.0003", "/data/web_text_document")
    assert (args["--tokenizer-type"], args["--tokenizer-model"]) == ("HuggingFaceTokenizer", "meta-llama/Meta-Llama-3-8B")
    assert args["--split"] == "99,1,0" and "--mock-data" not in args
    assert parse_megatron(text, {"DATA_PATH": "/other/prefix"})["--data-path"] == "/other/prefix"  # the environment wins
    mock = parse_megatron(emit_megatron(plan, MegatronRun(data_path="mock", tokenizer="null")).text)
    assert "--mock-data" in mock and mock["--tokenizer-type"] == "NullTokenizer" and "--data-path" not in mock


def test_megatron_notes_what_the_prediction_assumes_but_the_run_lacks():
    notes = emit_megatron(make_plan(tp=4, dp=8, sequence_parallel=False)).notes
    assert any("--tp-comm-overlap is off" in note and "sequence parallelism" in note for note in notes)
    notes = emit_megatron(make_plan(tp=4, dp=8, sequence_parallel=True)).notes
    assert [n for n in notes if "under megatron-core this layout is predicted" not in n] == []  # the plan has no engine


def test_megatron_order_of_size_one_axes_does_not_matter():
    plan = make_plan(tp=8, pp=1, dp=4, order="tp-pp-cp-ep-dp")  # pp=1: same groups as the default
    assert "--use-tp-pp-dp-mapping" not in parse_megatron(emit_megatron(plan).text)


def test_cli_emit_megatron_takes_run_flags_and_refuses_bad_ones(tmp_path, capsys):
    path = tmp_path / "plan.json"
    save_plan(make_plan(tp=2, dp=16, zero=1), path)
    assert run_cli(["emit", "megatron", str(path), "--data-path", "mock", "--tokenizer", "null",
                    "--train-iters", "20", "--lr", "1e-4"]) == 0
    args = parse_megatron(capsys.readouterr().out)
    assert "--mock-data" in args and (args["--train-iters"], args["--lr"]) == ("20", "0.0001")
    for bad in (["--train-iters", "0"], ["--lr", "nan"], ["--data-path", "a\nb"], ["--tokenizer", "--mock-data"]):
        assert run_cli(["emit", "megatron", str(path), *bad]) != 0
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error:") and bad[0] in err[0], err
