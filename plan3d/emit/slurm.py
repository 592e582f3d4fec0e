"""An sbatch script that starts one `plan3d launch` per node with the static rendezvous.

One task per node (`--ntasks-per-node=1`) on whole nodes (`--exclusive`); each task's node rank
comes from SLURM_NODEID (falling back to SLURM_PROCID), the master is the first host of
SLURM_JOB_NODELIST, and every launcher is told the same port, so torchrun's static rendezvous
gives the plan's placement.

The master address is assigned, checked and then exported in separate steps: `export X=$(cmd)`
returns export's status and hides a failing `cmd` from `set -e` (shellcheck SC2155), and an empty
address would start every launcher without a master. No pipe either (`| head` could hide
scontrol's failure behind SIGPIPE handling): the first host is cut from the list in the shell.

Resources: a CPU cluster (the spec's `cpu_cores_per_node`, which only CPU "GPUs" have, or the
`cpu-process` GPU) asks for no GPUs; the one task of a node starts all its ranks, so it gets the
node's cores: the spec's count, `--cpus-per-task` when given, else every CPU SLURM allocated on the
node (`$SLURM_CPUS_ON_NODE`, all of them under `--exclusive`). srun is given the count itself:
since SLURM 22.05 srun no longer inherits sbatch's --cpus-per-task.

Every value written is validated or quoted (`plan3d.run.flags`): #SBATCH values must match
SLURM's forms, and the per-node command is quoted twice, once for the inner `bash -c` (where
$NAME stays expandable) and once, whole, for the script's shell.
"""
from __future__ import annotations

import shlex

from plan3d.emit.launch_script import JobScript, sbatch_body
from plan3d.emit.nccl_env import nccl_lines
from plan3d.plan import Plan
from plan3d.run.flags import check_run_flags, check_script_flags, shell_line

CPU_GPU_NAME = "cpu-process"


def is_cpu_cluster(plan: Plan) -> bool:
    """True when the plan's "GPUs" are CPU processes (no GPU to ask SLURM for)."""
    return plan.cluster.cpu_cores_per_node is not None or plan.cluster.gpu.name == CPU_GPU_NAME


def node_cpus(plan: Plan, cpus_per_task: int | None) -> int | None:
    """Cores for a node's one task: the flag, else a CPU cluster's cores per node, else None (all allocated)."""
    return cpus_per_task if cpus_per_task is not None else plan.cluster.cpu_cores_per_node


def sbatch_script(plan: Plan, plan_path: str, steps: int = 100, run_dir: str = "runs/slurm-$SLURM_JOB_ID",
                  master_port: int = 29500, job_name: str = "plan3d", time_limit: str = "01:00:00",
                  partition: str | None = None, extra_args: list[str] | tuple[str, ...] = (),
                  plan3d_bin: str = "plan3d", cpus_per_task: int | None = None) -> str:
    """The script text; `sbatch` it from a directory every node sees."""
    check_run_flags(steps=steps, master_port=master_port)
    check_script_flags(job_name=job_name, time_limit=time_limit, partition=partition, cpus_per_task=cpus_per_task,
                       run_dir=run_dir, plan=plan_path, plan3d_bin=plan3d_bin)
    world, gpn = plan.layout.world_size, plan.gpus_per_node
    per_node = min(world, gpn)
    nnodes = -(-world // per_node)
    cpus = node_cpus(plan, cpus_per_task)
    launch = [plan3d_bin, "launch", plan_path, "--steps", str(steps), "--run-dir", run_dir,
              "--nnodes", str(nnodes), "--node-rank", "$NODE_RANK", "--master-addr", "$MASTER_ADDR",
              "--master-port", str(master_port), *map(str, extra_args)]
    inner = ("NODE_RANK=${SLURM_NODEID:-$SLURM_PROCID}; export PLAN3D_NODE_RANK=$NODE_RANK; "
             f"exec {shell_line(launch)}")
    srun_cpus = str(cpus) if cpus is not None else '"$SLURM_CPUS_ON_NODE"'
    kind = "CPU processes" if is_cpu_cluster(plan) else "GPUs"
    return "\n".join([
        "#!/bin/bash",
        f"# plan3d: {plan.model.name} {plan.layout.short()} on {nnodes} nodes x {per_node} {kind}, static rendezvous",
        *_header(plan, nnodes, per_node, cpus, job_name, time_limit, partition),
        "set -euo pipefail",
        *_master_address(),
        *([] if is_cpu_cluster(plan) else nccl_lines(plan, nnodes)),  # gloo on CPU clusters: no NCCL
        "# single quotes on purpose: NODE_RANK and the $ variables expand in each node's bash",
        "# shellcheck disable=SC2016",
        f"srun --ntasks={nnodes} --ntasks-per-node=1 --cpus-per-task={srun_cpus} bash -c {shlex.quote(inner)}",
    ]) + "\n"


def engine_sbatch_script(plan: Plan, job: JobScript, job_name: str = "plan3d", time_limit: str = "01:00:00",
                         partition: str | None = None, cpus_per_task: int | None = None) -> str:
    """An sbatch script that starts an engine's job (`job`: plan3d.emit.launch_script) on every
    node, as the node script would, with SLURM's node ids as node ranks."""
    check_script_flags(job_name=job_name, time_limit=time_limit, partition=partition, cpus_per_task=cpus_per_task)
    world, gpn = plan.layout.world_size, plan.gpus_per_node
    per_node = min(world, gpn)
    nnodes = -(-world // per_node)
    cpus = node_cpus(plan, cpus_per_task)
    comments, body = sbatch_body(plan, job, str(cpus) if cpus is not None else '"$SLURM_CPUS_ON_NODE"')
    return "\n".join(["#!/bin/bash", *comments, *_header(plan, nnodes, per_node, cpus, job_name, time_limit, partition),
                      "set -euo pipefail", *_master_address(), *body]) + "\n"


def _header(plan: Plan, nnodes: int, per_node: int, cpus: int | None, job_name: str, time_limit: str,
            partition: str | None) -> list[str]:
    lines = [f"--job-name={job_name}", f"--nodes={nnodes}", "--ntasks-per-node=1"]
    if not is_cpu_cluster(plan):
        lines.append(f"--gpus-per-node={per_node}")
    if cpus is not None:
        lines.append(f"--cpus-per-task={cpus}")
    lines += ["--exclusive", f"--time={time_limit}"]
    if partition:
        lines.append(f"--partition={partition}")
    return [f"#SBATCH {line}" for line in lines]


def _master_address() -> list[str]:
    """Assign, check, export: a failing scontrol stops the script (set -e), an empty host list too."""
    return [
        'nodes=$(scontrol show hostnames "$SLURM_JOB_NODELIST")',
        "MASTER_ADDR=${nodes%%[[:space:]]*}",
        'if [ -z "$MASTER_ADDR" ]; then',
        '  echo "error: scontrol listed no host for SLURM_JOB_NODELIST=\'$SLURM_JOB_NODELIST\'; submit this script '
        'with sbatch" >&2',
        "  exit 1",
        "fi",
        "export MASTER_ADDR",
    ]
