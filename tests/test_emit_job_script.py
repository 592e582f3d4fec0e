"""The engine job scripts (`emit megatron`, `emit torchrun|slurm --engine megatron-core`), run with
bash and stub launchers: what each node starts, with which environment, where it writes."""
from __future__ import annotations

import json

import pytest

from cli_helpers import run_cli
from emit_helpers import make_plan
from script_helpers import REQUIRED_DEFAULTS, flags, run_script
from plan3d.cost.estimate import estimate
from plan3d.emit.deepspeed import emit_deepspeed
from plan3d.emit.launch_script import node_script
from plan3d.emit.launchers import deepspeed_job, torchtitan_job
from plan3d.emit.megatron import MegatronRun, emit_megatron, megatron_job
from plan3d.emit.torchtitan import emit_torchtitan
from plan3d.emit.nccl_env import network_kind
from plan3d.emit.slurm import engine_sbatch_script
from plan3d.plan import build_plan, save_plan
from plan3d.specs.catalog import load_cluster, load_engine

RUN = MegatronRun(data_path="mock", tokenizer="null", train_iters=10, lr=3e-4)


def megatron_plan(nodes=4, **layout):
    """A plan predicted for megatron-core (estimate and engine), on `nodes` DGX H100 nodes."""
    base = make_plan(**({"tp": 4, "dp": 8, "zero": 1, "sequence_parallel": True} | layout))
    cluster = load_cluster("dgx-h100", nodes=nodes)
    engine = load_engine("megatron-core")
    est = estimate(cluster, base.model, base.training, base.layout, engine=engine).to_dict()
    return build_plan(cluster, base.model, base.training, base.layout, est, engine)


def test_each_node_starts_torchrun_with_its_rank_and_the_shared_master():
    text = emit_megatron(megatron_plan(), RUN).text
    stopped = run_script(text, {"MEGATRON_LM": "/m"}, fill_required=False)
    assert stopped.returncode != 0 and stopped.argv == [] and "set MASTER_ADDR " in stopped.stderr
    for node in range(4):
        run = run_script(text, {"SLURM_NODEID": str(node)})
        assert run.returncode == 0, run.stderr
        options = flags(run.torchrun_options())
        assert (options["--node-rank"], options["--nnodes"], options["--nproc-per-node"]) == (str(node), "4", "8")
        assert (options["--master-addr"], options["--rdzv-backend"]) == (REQUIRED_DEFAULTS["MASTER_ADDR"], "static")
        assert options["--log-dir"].endswith(f"/logs/node{node}")
        assert run.argv[len(run.torchrun_options())] == "/opt/Megatron-LM/pretrain_gpt.py"
    assert flags(run_script(text, {"NODE_RANK": "3", "SLURM_NODEID": "1"}).torchrun_options())["--node-rank"] == "3"


def test_the_run_directory_holds_checkpoints_logs_and_tensorboard():
    run = run_script(emit_megatron(megatron_plan(), RUN).text)
    assert {"checkpoints", "logs", "tensorboard"} <= set(run.run_dirs)
    args = flags(run.program_args())
    assert args["--save"] == args["--load"] and args["--save"].endswith("/run/checkpoints")
    assert args["--tensorboard-dir"].endswith("/run/tensorboard") and args["--save-interval"] == "10"


def test_arguments_after_the_script_go_to_megatron_last():
    run = run_script(emit_megatron(megatron_plan(), RUN).text, args=["--log-interval", "5", "--lr", "1e-5"])
    assert run.program_args()[-4:] == ["--log-interval", "5", "--lr", "1e-5"]
    assert flags(run.program_args())["--lr"] == "1e-5"  # argparse keeps the last


def test_given_values_are_literal_even_with_shell_characters():
    odd = "/data/my corpus/$HOME `x` it's"
    run = run_script(emit_megatron(megatron_plan(), MegatronRun(data_path=odd, tokenizer="null", train_iters=3,
                                                               lr=1e-4)).text)
    assert run.returncode == 0, run.stderr
    assert flags(run.program_args())["--data-path"] == odd


def test_header_names_the_engine_plan_and_prediction():
    plan = megatron_plan()
    head = emit_megatron(plan, RUN).text.splitlines()[:4]
    assert "megatron-core" in head[1] and plan.digest in head[1] and plan.layout.short() in head[1]
    assert "4 node(s) x 8 GPUs = world 32" in head[2]
    assert f"step {plan.estimate.step_time_s:.3g} s" in head[3] and "predicted for megatron-core" in head[3]


def test_nccl_settings_follow_the_network_and_the_environment_wins():
    run = run_script(emit_megatron(megatron_plan(), RUN).text)
    assert (run.env["NCCL_IB_HCA"], run.env["NCCL_SOCKET_IFNAME"]) == ("mlx5", "^lo,docker0")
    assert "NCCL_IB_DISABLE" not in run.env
    site = run_script(emit_megatron(megatron_plan(), RUN).text, {"NCCL_IB_HCA": "mlx5_0,mlx5_3"})
    assert site.env["NCCL_IB_HCA"] == "mlx5_0,mlx5_3"
    single = run_script(emit_megatron(megatron_plan(nodes=1, tp=2, dp=4), RUN).text)
    assert "NCCL_IB_HCA" not in single.env and single.env["NCCL_SOCKET_IFNAME"] == "^lo,docker0"


@pytest.mark.parametrize("tier, kind", [("ib-ndr", "infiniband"), ("ethernet-roce", "roce"), ("ethernet-100g", "ethernet"),
                                        ("slingshot", "unknown")])
def test_network_kind_is_read_from_the_outer_tier_name(tier, kind):
    plan = megatron_plan()
    network = [*plan.cluster.network[:-1], plan.cluster.network[-1].model_copy(update={"name": tier})]
    renamed = plan.model_copy(update={"cluster": plan.cluster.model_copy(update={"network": network})})
    assert network_kind(renamed, 4) == (kind, tier)
    env = run_script(emit_megatron(renamed, RUN).text).env
    assert ("NCCL_IB_GID_INDEX" in env) == (kind == "roce") and ("NCCL_IB_DISABLE" in env) == (kind == "ethernet")


def test_sbatch_starts_one_torchrun_per_node_with_slurms_node_id():
    plan = megatron_plan()
    job, _ = megatron_job(plan, RUN)
    text = engine_sbatch_script(plan, job, job_name="llama", partition="gpu")
    assert "#SBATCH --nodes=4" in text and "#SBATCH --gpus-per-node=8" in text and "#SBATCH --partition=gpu" in text
    run = run_script(text, {"SLURM_CPUS_ON_NODE": "96"})
    assert run.returncode == 0, run.stderr
    assert "--ntasks=4" in run.srun_argv and "--cpus-per-task=96" in run.srun_argv
    options = flags(run.torchrun_options())
    assert (options["--node-rank"], options["--master-addr"], options["--nnodes"]) == ("0", "node-a", "4")
    assert options["--log-dir"].endswith("/run/logs/node0")
    assert flags(run.program_args())["--tensor-model-parallel-size"] == "4"


def test_cli_launchers_start_the_plans_engine(tmp_path, capsys):
    path = tmp_path / "plan.json"
    save_plan(megatron_plan(), path)
    code, out, err = run_cli(capsys, "emit", "torchrun", path, "--data-path", "mock", "--tokenizer", "null",
                             "--train-iters", "5", "--lr", "1e-4")
    assert code == 0, err
    assert flags(run_script(out).program_args())["--train-iters"] == "5"
    code, out, err = run_cli(capsys, "emit", "slurm", path, "--engine", "plan3d-runtime")
    assert code == 0 and "plan3d launch" in out
    assert "predictions are for megatron-core" in err and "plan3d emit megatron" in err
    code, _, err = run_cli(capsys, "emit", "slurm", path, "--engine", "megatron-deepspeed")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "plan3d emit deepspeed" in err


def test_cli_a_plan_for_an_engine_without_a_launcher_says_the_runtime_starts(tmp_path, capsys):
    base = megatron_plan(sequence_parallel=False)
    engine = load_engine("megatron-deepspeed")
    est = estimate(base.cluster, base.model, base.training, base.layout, engine=engine).to_dict()
    path = tmp_path / "mds.json"
    save_plan(build_plan(base.cluster, base.model, base.training, base.layout, est, engine), path)
    code, out, err = run_cli(capsys, "emit", "torchrun", path)
    assert code == 0 and "plan3d.runtime.worker" in out
    assert "predictions are for megatron-deepspeed" in err and "starts plan3d-runtime" in err


def engine_plan(engine_name: str, **layout):
    base = megatron_plan(**({"zero": 3} | layout))
    engine = load_engine(engine_name)
    est = estimate(base.cluster, base.model, base.training, base.layout, engine=engine).to_dict()
    return build_plan(base.cluster, base.model, base.training, base.layout, est, engine)


def test_torchtitan_job_writes_its_module_and_runs_torchtitan_train():
    plan = engine_plan("torchtitan")
    job, _ = torchtitan_job(plan, "torchtitan", 25)
    run = run_script(node_script(plan, job), {"SLURM_NODEID": "1"})
    assert run.returncode == 0, run.stderr
    assert run.run_files["job/plan3d_job.py"] == emit_torchtitan(plan).text  # byte for byte, nothing expanded
    assert not any(".tmp." in name for name in run.run_files)
    options = run.torchrun_options("torchtitan.train")
    assert options[-1] == "-m" and flags(options)["--node-rank"] == "1"
    args = flags(run.program_args("torchtitan.train"))
    assert (args["--module"], args["--config"], args["--training.steps"]) == ("plan3d_job", "plan3d_job", "25")
    assert args["--dump_folder"].endswith("/run") and run.env["PYTHONPATH"].split(":")[0].endswith("/run/job")
    assert args["--hf_assets_path"] == "/assets/hf/Llama-3.1-8B"  # required from the environment
    stopped = run_script(node_script(plan, job), {"TRAIN_STEPS": "3", "MASTER_ADDR": "h"}, fill_required=False)
    assert stopped.returncode != 0 and "set HF_ASSETS " in stopped.stderr
    given, _ = torchtitan_job(plan, "torchtitan", 25, "/models/llama3-8b")
    assert flags(run_script(node_script(plan, given)).program_args("torchtitan.train"))["--hf_assets_path"] == \
        "/models/llama3-8b"


def test_deepspeed_job_runs_the_users_script_with_the_plans_config():
    plan = engine_plan("deepspeed-0.19", tp=1, dp=32, sequence_parallel=False)
    job, _ = deepspeed_job(plan)
    text = node_script(plan, job)
    assert "set TRAIN_SCRIPT " in run_script(text, {"MASTER_ADDR": "h"}, fill_required=False).stderr
    run = run_script(text, {"TRAIN_SCRIPT": "/work/pretrain.py"})
    assert run.returncode == 0, run.stderr
    assert json.loads(run.run_files["ds_config.json"]) == json.loads(emit_deepspeed(plan).text)
    args = run.program_args("pretrain.py")
    assert args[0] == "--deepspeed" and args[1] == "--deepspeed_config" and args[2].endswith("/run/ds_config.json")


@pytest.mark.parametrize("engine_name, launched", [("torchtitan", "torchtitan.train"), ("deepspeed-0.19", "train.py"),
                                                   ("megatron-core", "pretrain_gpt.py")])
def test_cli_sbatch_starts_each_engine(tmp_path, capsys, engine_name, launched):
    path = tmp_path / "plan.json"
    layout = {"tp": 1, "dp": 32, "sequence_parallel": False} if engine_name.startswith("deepspeed") else {}
    save_plan(engine_plan(engine_name, **layout), path)
    code, out, err = run_cli(capsys, "emit", "slurm", path, "--train-iters", "5", "--data-path", "mock",
                             "--tokenizer", "null", "--lr", "1e-4")
    assert code == 0, err
    run = run_script(out, {"SLURM_CPUS_ON_NODE": "64"})
    assert run.returncode == 0, run.stderr
    assert any(a.endswith(launched) for a in run.argv) and flags(run.torchrun_options(launched))["--nnodes"] == "4"
    assert "predictions are for" not in err


def test_the_runtime_sbatch_states_the_nccl_settings_too(tmp_path, capsys):
    path = tmp_path / "plan.json"
    save_plan(megatron_plan(), path)
    code, out, _ = run_cli(capsys, "emit", "slurm", path, "--engine", "plan3d-runtime")
    assert code == 0 and 'export NCCL_IB_HCA="${NCCL_IB_HCA:-mlx5}"' in out and "plan3d launch" in out
