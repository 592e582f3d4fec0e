"""Emitters: each output is parsed back and its values checked against the plan."""
from __future__ import annotations

import json
import shlex
import tomllib

import pytest

from plan3d.cli import main
from plan3d.emit.deepspeed import emit_deepspeed
from plan3d.emit.megatron import emit_megatron
from plan3d.emit.torchtitan import emit_torchtitan
from plan3d.errors import InfeasibleError
from plan3d.layout import Layout
from plan3d.plan import build_plan, save_plan
from plan3d.specs.catalog import load_cluster, load_model
from plan3d.specs.training import TrainingSpec


def make_plan(model="llama3-8b", global_batch=64, precision="bf16", **layout):
    cluster = load_cluster("dgx-h100", nodes=4)
    return build_plan(cluster, load_model(model), TrainingSpec(global_batch=global_batch, precision=precision),
                      Layout(**layout))


def parse_megatron(text: str) -> dict[str, str | bool]:
    """Flags to values (True for switches), from the emitted shell block."""
    body = " ".join(line for line in text.splitlines() if not line.startswith("#"))
    tokens = shlex.split(body.replace("\\", " "))
    out, i = {}, 0
    while i < len(tokens):
        if i + 1 < len(tokens) and not tokens[i + 1].startswith("--"):
            out[tokens[i]], i = tokens[i + 1], i + 2
        else:
            out[tokens[i]], i = True, i + 1
    return out


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
        assert int(args["--num-layers-per-virtual-pipeline-stage"]) * pp * vpp == plan.model.layers
    assert "--use-tp-pp-dp-mapping" not in args
    assert int(args["--num-layers"]) == plan.model.layers
    assert int(args["--num-query-groups"]) == plan.model.kv_heads_
    assert args["--normalization"] == "RMSNorm" and "--swiglu" in args and "--bf16" in args


def test_megatron_pp_dp_order_and_uneven_split():
    plan = make_plan(tp=2, pp=4, dp=4, order="tp-cp-ep-pp-dp", pp_layers=(7, 9, 9, 7))
    args = parse_megatron(emit_megatron(plan).text)
    assert "--use-tp-pp-dp-mapping" in args
    assert (args["--decoder-first-pipeline-num-layers"], args["--decoder-last-pipeline-num-layers"]) == ("7", "7")


@pytest.mark.parametrize("layout,needle", [
    ({"tp": 8, "pp": 1, "dp": 4, "zero": 3}, "ZeRO-3"),
    ({"tp": 2, "pp": 2, "dp": 8, "order": "dp-tp-cp-ep-pp"}, "rank order"),
    ({"tp": 1, "pp": 4, "dp": 8, "pp_layers": (7, 9, 8, 8)}, "middle stages"),
])
def test_megatron_refuses_what_it_cannot_express(layout, needle):
    with pytest.raises(InfeasibleError, match=needle):
        emit_megatron(make_plan(**layout))


def test_megatron_order_of_size_one_axes_does_not_matter():
    plan = make_plan(tp=8, pp=1, dp=4, order="tp-pp-cp-ep-dp")  # pp=1: same groups as the default
    assert "--use-tp-pp-dp-mapping" not in parse_megatron(emit_megatron(plan).text)


@pytest.mark.parametrize("tp,pp,dp,mb,zero,precision", [
    (1, 1, 32, 2, 3, "bf16"), (1, 4, 8, 1, 1, "fp16"), (4, 1, 8, 1, 2, "bf16"),
])
def test_deepspeed_values(tp, pp, dp, mb, zero, precision):
    plan = make_plan(tp=tp, pp=pp, dp=dp, micro_batch=mb, zero=zero, precision=precision)
    emitted = emit_deepspeed(plan)
    config = json.loads(emitted.text)
    assert config["zero_optimization"]["stage"] == zero
    assert config["train_micro_batch_size_per_gpu"] == mb
    # DeepSpeed's own invariant: batch = micro * accumulation * data-parallel size.
    assert config["train_batch_size"] == mb * config["gradient_accumulation_steps"] * dp == 64
    assert config["bf16"]["enabled"] == (precision == "bf16")
    assert config["fp16"]["enabled"] == (precision == "fp16")
    assert config.get("tensor_parallel", {"autotp_size": 1})["autotp_size"] == tp
    assert any("PipelineModule(num_stages=4" in n for n in emitted.notes) == (pp == 4)


@pytest.mark.parametrize("layout,needle", [
    ({"pp": 4, "dp": 8, "zero": 2}, "ZeRO-0/1"),
    ({"tp": 4, "dp": 8, "zero": 3}, "AutoTP"),
    ({"pp": 2, "dp": 16, "order": "tp-cp-ep-pp-dp"}, "rank order"),
])
def test_deepspeed_refuses(layout, needle):
    with pytest.raises(InfeasibleError, match=needle):
        emit_deepspeed(make_plan(**layout))


@pytest.mark.parametrize("tp,pp,dp,vpp,mb,zero,recompute", [
    (2, 4, 4, 2, 1, 3, "full"), (8, 1, 4, 1, 2, 2, "selective"), (1, 1, 32, 1, 2, 0, "none"),
])
def test_torchtitan_values(tp, pp, dp, vpp, mb, zero, recompute):
    plan = make_plan(tp=tp, pp=pp, dp=dp, vpp=vpp, micro_batch=mb, zero=zero, recompute=recompute,
                     sequence_parallel=tp > 1)
    toml = tomllib.loads(emit_torchtitan(plan).text)
    par, train = toml["parallelism"], toml["training"]
    assert par["tensor_parallel_degree"] == tp and par["pipeline_parallel_degree"] == pp
    assert par["data_parallel_shard_degree"] * par["data_parallel_replicate_degree"] == dp
    assert (par["data_parallel_shard_degree"] == dp) == (zero >= 2)
    assert (par.get("fsdp_reshard_after_forward") == "never") == (zero == 2)
    assert train["global_batch_size"] == 64 and train["seq_len"] == plan.model.seq_len
    assert toml["activation_checkpoint"]["mode"] == recompute
    if pp > 1:
        assert par["pipeline_parallel_schedule"] == ("Interleaved1F1B" if vpp > 1 else "1F1B")
        assert par["pipeline_parallel_layers_per_stage"] * pp * vpp == plan.model.layers
        assert train["local_batch_size"] * dp == 64 and par["pipeline_parallel_microbatch_size"] == mb
    else:
        assert train["local_batch_size"] == mb


def test_torchtitan_uneven_split_points_and_refusals():
    plan = make_plan(pp=4, dp=8, zero=3, pp_layers=(7, 9, 9, 7))
    par = tomllib.loads(emit_torchtitan(plan).text)["parallelism"]
    assert par["pipeline_parallel_split_points"] == ["layers.7", "layers.16", "layers.25"]
    with pytest.raises(InfeasibleError, match="ZeRO-1"):
        emit_torchtitan(make_plan(dp=32, zero=1))
    with pytest.raises(InfeasibleError, match="DDP"):
        emit_torchtitan(make_plan(tp=2, dp=16, zero=0))


def run_cli(args: list[str]) -> int:
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    return exit_info.value.code or 0


def test_cli_emit_writes_file_and_exits_1_when_inexpressible(tmp_path, capsys):
    path = tmp_path / "plan.json"
    save_plan(make_plan(tp=8, pp=2, dp=2, zero=1), path)
    assert run_cli(["emit", "deepspeed", str(path)]) == 1
    assert "error:" in capsys.readouterr().err
    assert run_cli(["emit", "megatron", str(path)]) == 0
    assert parse_megatron(capsys.readouterr().out)["--tensor-model-parallel-size"] == "8"
    save_plan(make_plan(tp=8, pp=2, dp=2, zero=3), path)
    out = tmp_path / "titan.toml"
    assert run_cli(["emit", "torchtitan", str(path), "-o", str(out)]) == 0
    assert tomllib.loads(out.read_text())["parallelism"]["data_parallel_shard_degree"] == 2


def test_cli_emit_torchrun_one_line_per_node(tmp_path, capsys):
    path = tmp_path / "plan.json"
    save_plan(make_plan(tp=8, pp=2, dp=2, zero=1), path)  # 32 ranks on 4 DGX nodes
    assert run_cli(["emit", "torchrun", str(path), "--master-port", "29511", "--steps", "7"]) == 0
    commands = [shlex.split(line) for line in capsys.readouterr().out.splitlines() if not line.startswith("#")]
    assert len(commands) == 4
    for node, argv in enumerate(commands):
        assert f"--node-rank={node}" in argv and "--nproc-per-node=8" in argv and "--nnodes=4" in argv
        assert "--rdzv-backend=static" in argv and "--master-port=29511" in argv
        assert argv[argv.index("--plan") + 1] == str(path) and argv[argv.index("--steps") + 1] == "7"


def test_cli_emit_slurm_script(tmp_path, capsys):
    path = tmp_path / "plan.json"
    save_plan(make_plan(tp=8, pp=2, dp=2, zero=1), path)
    assert run_cli(["emit", "slurm", str(path), "--steps", "9", "--partition", "gpu", "--time", "02:00:00"]) == 0
    script = capsys.readouterr().out
    headers = dict(line[len("#SBATCH --"):].split("=", 1) for line in script.splitlines() if line.startswith("#SBATCH"))
    assert headers["nodes"] == "4" and headers["gpus-per-node"] == "8"
    assert headers["partition"] == "gpu" and headers["time"] == "02:00:00"
    assert "--steps 9" in script and str(path) in script


@pytest.mark.parametrize("command,flags,needle", [
    ("torchrun", ["--master-port", "1" * 31], "--master-port must be a port"),
    ("torchrun", ["--steps", "0"], "--steps must be a positive integer"),
    ("torchrun", ["--timeout-s", "inf"], "--timeout-s must be a finite number"),
    ("torchrun", ["--master-addr", "$(reboot)"], "--master-addr must be"),
    ("torchrun", ["--run-dir", "runs/`id`$(id)"], "--run-dir may use $NAME"),
    ("slurm", ["--master-port", "70000"], "--master-port must be a port"),
    ("slurm", ["--steps", "0"], "--steps must be a positive integer"),
    ("slurm", ["--job-name", "x\n#SBATCH --nodes=999"], "--job-name must be"),
    ("slurm", ["--time", "forever"], "--time must be HH:MM:SS"),
    ("slurm", ["--partition", "gpu\nrm -rf ~"], "--partition must be"),
    ("slurm", ["--run-dir", "runs/a\necho pwned"], "--run-dir must be a path without line breaks"),
])
def test_emit_refuses_what_launch_refuses_and_what_a_script_cannot_hold(tmp_path, capsys, command, flags, needle):
    """One validation (plan3d.run_flags) for launch and both emitters: exit 2, one line, nothing written."""
    path, out = tmp_path / "plan.json", tmp_path / "out.sh"
    save_plan(make_plan(tp=8, pp=2, dp=2, zero=1), path)
    assert run_cli(["emit", command, str(path), "-o", str(out), *flags]) == 2
    err = capsys.readouterr().err
    assert needle in err and err.startswith("error:") and "Traceback" not in err
    assert not out.exists()


@pytest.mark.parametrize("time_limit", ["30", "30:00", "02:00:00", "1-12", "1-12:30", "2-00:00:00"])
def test_emit_slurm_takes_slurms_time_forms(tmp_path, capsys, time_limit):
    path = tmp_path / "plan.json"
    save_plan(make_plan(tp=8, pp=2, dp=2, zero=1), path)
    assert run_cli(["emit", "slurm", str(path), "--time", time_limit]) == 0
    assert f"#SBATCH --time={time_limit}\n" in capsys.readouterr().out


def _srun_argv(script: str) -> list[str]:
    """The per-node `plan3d launch` argv, after both shells' quoting (outer script, inner bash -c)."""
    srun = next(line for line in script.splitlines() if line.startswith("srun "))
    outer = shlex.split(srun)
    inner = outer[outer.index("-c") + 1]
    return shlex.split(inner.split("exec ", 1)[1])


def test_emit_slurm_quotes_paths_and_keeps_variables_expandable(tmp_path, capsys):
    odd = tmp_path / "my plans" / "it's.json"
    odd.parent.mkdir()
    save_plan(make_plan(tp=8, pp=2, dp=2, zero=1), odd)
    assert run_cli(["emit", "slurm", str(odd), "--run-dir", "runs/a b-$SLURM_JOB_ID", "--job-name", "llama.8b_x"]) == 0
    script = capsys.readouterr().out
    argv = _srun_argv(script)
    assert argv[2] == str(odd)
    assert argv[argv.index("--run-dir") + 1] == "runs/a b-$SLURM_JOB_ID"  # one word; $ left to the node's bash
    assert "#SBATCH --job-name=llama.8b_x\n" in script
    assert sum(line.startswith("#SBATCH") for line in script.splitlines()) == 5


def test_emit_torchrun_quotes_the_run_directory(tmp_path, capsys):
    path = tmp_path / "plan.json"
    save_plan(make_plan(tp=8, pp=2, dp=2, zero=1), path)
    assert run_cli(["emit", "torchrun", str(path), "--run-dir", "runs/a b; rm -rf x", "--timeout-s", "60"]) == 0
    argv = shlex.split(capsys.readouterr().out.splitlines()[1])
    assert argv[argv.index("--run-dir") + 1] == "runs/a b; rm -rf x"
    assert "--rdzv-conf=timeout=60" in argv and argv[argv.index("--timeout-s") + 1] == "60.0"
