"""An sbatch script that starts one `plan3d launch` per node with the static rendezvous.

One task per node (`--ntasks-per-node=1`); each task's node rank comes from SLURM_NODEID
(falling back to SLURM_PROCID), the master is the first host of SLURM_JOB_NODELIST, and every
launcher is told the same port, so torchrun's static rendezvous gives the plan's placement.

Every value written is validated or quoted (`plan3d.run_flags`): #SBATCH values must match
SLURM's forms, and the per-node command is quoted twice, once for the inner `bash -c` (where
$NAME stays expandable) and once, whole, for the script's shell.
"""
from __future__ import annotations

import shlex

from plan3d.plan import Plan
from plan3d.run_flags import check_run_flags, check_script_flags, shell_line


def sbatch_script(plan: Plan, plan_path: str, steps: int = 100, run_dir: str = "runs/slurm-$SLURM_JOB_ID",
                  master_port: int = 29500, job_name: str = "plan3d", time_limit: str = "01:00:00",
                  partition: str | None = None, extra_args: list[str] | tuple[str, ...] = (),
                  plan3d_bin: str = "plan3d") -> str:
    """The script text; `sbatch` it from a directory every node sees."""
    check_run_flags(steps=steps, master_port=master_port)
    check_script_flags(job_name=job_name, time_limit=time_limit, partition=partition, run_dir=run_dir,
                       plan=plan_path, plan3d_bin=plan3d_bin)
    world, gpn = plan.layout.world_size, int(plan.rankmap.get("gpus_per_node", plan.cluster.gpus_per_node))
    per_node = min(world, gpn)
    nnodes = -(-world // per_node)
    header = [f"#SBATCH --job-name={job_name}", f"#SBATCH --nodes={nnodes}", "#SBATCH --ntasks-per-node=1",
              f"#SBATCH --gpus-per-node={per_node}", f"#SBATCH --time={time_limit}"]
    if partition:
        header.append(f"#SBATCH --partition={partition}")
    launch = [plan3d_bin, "launch", plan_path, "--steps", str(steps), "--run-dir", run_dir,
              "--nnodes", str(nnodes), "--node-rank", "$NODE_RANK", "--master-addr", "$MASTER_ADDR",
              "--master-port", str(master_port), *map(str, extra_args)]
    inner = ("NODE_RANK=${SLURM_NODEID:-$SLURM_PROCID}; export PLAN3D_NODE_RANK=$NODE_RANK; "
             f"exec {shell_line(launch)}")
    body = [
        'export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        f"srun --ntasks={nnodes} --ntasks-per-node=1 bash -c {shlex.quote(inner)}",
    ]
    return "\n".join(["#!/bin/bash", f"# plan3d: {plan.model.name} {plan.layout.short()} on {nnodes} nodes "
                      f"x {per_node} GPUs, static rendezvous", *header, "set -euo pipefail", *body]) + "\n"
