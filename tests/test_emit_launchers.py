"""torchrun and SLURM launchers: one launcher per node, validated and quoted flags."""
from __future__ import annotations

import shlex

import pytest

from emit_helpers import make_plan, run_cli
from plan3d.layout import Layout
from plan3d.plan import build_plan, save_plan
from plan3d.specs.catalog import load_cluster, load_model
from plan3d.specs.training import TrainingSpec


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
    headers = _headers(script)
    assert headers["nodes"] == "4" and headers["gpus-per-node"] == "8" and headers["exclusive"] is True
    assert "cpus-per-task" not in headers  # a GPU spec has no core count: srun gets $SLURM_CPUS_ON_NODE
    assert '--cpus-per-task="$SLURM_CPUS_ON_NODE"' in script
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
    ("slurm", ["--cpus-per-task", "0"], "--cpus-per-task must be a positive integer"),
])
def test_emit_refuses_what_launch_refuses_and_what_a_script_cannot_hold(tmp_path, capsys, command, flags, needle):
    """One validation (plan3d.run.flags) for launch and both emitters: exit 2, one line, nothing written."""
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
    # job-name, nodes, ntasks-per-node, gpus-per-node, exclusive, time: nothing else reaches #SBATCH
    assert sum(line.startswith("#SBATCH") for line in script.splitlines()) == 6


def _headers(script: str) -> dict[str, str | bool]:
    pairs = (line[len("#SBATCH --"):].partition("=") for line in script.splitlines() if line.startswith("#SBATCH"))
    return {key: val if eq else True for key, eq, val in pairs}


def test_emit_slurm_asks_a_cpu_cluster_for_cores_not_gpus(tmp_path, capsys):
    """local-cpu's ranks are CPU processes (cpu_cores_per_node: 2): no --gpus-per-node, its cores per task."""
    plan = build_plan(load_cluster("local-cpu"), load_model("tiny-gpt"), TrainingSpec(global_batch=8),
                      Layout(tp=2, dp=4))
    path = tmp_path / "plan.json"
    save_plan(plan, path)
    assert run_cli(["emit", "slurm", str(path)]) == 0
    script = capsys.readouterr().out
    headers = _headers(script)
    assert "gpus-per-node" not in headers and headers["cpus-per-task"] == "2" and headers["exclusive"] is True
    assert "srun --ntasks=1 --ntasks-per-node=1 --cpus-per-task=2 " in script
    assert run_cli(["emit", "slurm", str(path), "--cpus-per-task", "16"]) == 0
    assert _headers(capsys.readouterr().out)["cpus-per-task"] == "16"


def test_emit_slurm_checks_the_master_address_before_exporting_it(tmp_path, capsys):
    """SC2155: `export X=$(cmd)` would hide a failing scontrol from set -e; an empty address stops the job."""
    path = tmp_path / "plan.json"
    save_plan(make_plan(tp=8, pp=2, dp=2, zero=1), path)
    assert run_cli(["emit", "slurm", str(path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert not any(line.startswith("export") and "$(" in line for line in lines)
    assigned, exported = lines.index("MASTER_ADDR=${nodes%%[[:space:]]*}"), lines.index("export MASTER_ADDR")
    assert any('[ -z "$MASTER_ADDR" ]' in line for line in lines[assigned:exported])

def test_emit_torchrun_quotes_the_run_directory(tmp_path, capsys):
    path = tmp_path / "plan.json"
    save_plan(make_plan(tp=8, pp=2, dp=2, zero=1), path)
    assert run_cli(["emit", "torchrun", str(path), "--run-dir", "runs/a b; rm -rf x", "--timeout-s", "60"]) == 0
    argv = shlex.split(capsys.readouterr().out.splitlines()[1])
    assert argv[argv.index("--run-dir") + 1] == "runs/a b; rm -rf x"
    assert "--rdzv-conf=timeout=60" in argv and argv[argv.index("--timeout-s") + 1] == "60.0"
