"""`plan3d emit megatron|deepspeed|torchtitan|torchrun|slurm PLAN.json [-o FILE]`.

The text goes to stdout or FILE; notes (settings that live in user code) go to stderr as
`note: ...`. A plan the engine cannot express exits 1 with `error: <what to change>`.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from plan3d.cli.app import app

emit_app = typer.Typer(help="Write a plan in another tool's words: Megatron-LM, DeepSpeed, torchtitan, "
                            "torchrun, SLURM.", no_args_is_help=True)
app.add_typer(emit_app, name="emit")

PlanArg = Annotated[str, typer.Argument(help="A plan JSON (`plan3d recommend --out PLAN.json`, or a run's plan.json).")]
OutOpt = Annotated[Optional[Path], typer.Option("--output", "-o", help="Write here instead of stdout.")]


def _write(emitted, out: Path | None) -> None:
    for note in emitted.notes:
        print(f"note: {note}", file=sys.stderr)
    if out is None:
        sys.stdout.write(emitted.text)
        return
    out.write_text(emitted.text)
    from plan3d.render.units import printable

    print(printable(f"wrote {out}"), file=sys.stderr)


@emit_app.command("megatron")
def emit_megatron_cmd(
    plan: PlanArg, out: OutOpt = None,
    data_path: Annotated[Optional[str], typer.Option("--data-path", help="Megatron dataset prefix (.bin/.idx), "
                                                     "or 'mock' for synthetic tokens.")] = None,
    tokenizer: Annotated[Optional[str], typer.Option("--tokenizer", help="Hugging Face tokenizer name or path, "
                                                     "or 'null' (the model's vocabulary, for mock data).")] = None,
    train_iters: Annotated[Optional[int], typer.Option("--train-iters", help="Training iterations.")] = None,
    lr: Annotated[Optional[float], typer.Option("--lr", help="Peak learning rate.")] = None,
) -> None:
    """Megatron-Core 0.17-0.19 `pretrain_gpt.py` arguments: parallel sizes, ZeRO (distributed optimizer,
    Megatron-FSDP), overlap, batch, recompute, model shape; data, tokenizer and schedule from the
    flags, or named in a comment when not given."""
    from plan3d.emit.megatron import MegatronRun, check_megatron_run, emit_megatron
    from plan3d.plan import load_plan

    run = MegatronRun(data_path=data_path, tokenizer=tokenizer, train_iters=train_iters, lr=lr)
    check_megatron_run(run)
    _write(emit_megatron(load_plan(plan), run), out)


@emit_app.command("deepspeed")
def emit_deepspeed_cmd(plan: PlanArg, out: OutOpt = None) -> None:
    """A DeepSpeed ds_config.json (ZeRO stage, micro-batch, accumulation, precision, AutoTP)."""
    from plan3d.emit.deepspeed import emit_deepspeed
    from plan3d.plan import load_plan

    _write(emit_deepspeed(load_plan(plan)), out)


CompileOpt = Annotated[Optional[bool], typer.Option(
    "--compile/--no-compile", help="torch.compile each block (the torchtitan-compile profile); "
    "default: as the plan's engine.")]


@emit_app.command("torchtitan")
def emit_torchtitan_cmd(plan: PlanArg, out: OutOpt = None, compile: CompileOpt = None) -> None:
    """torchtitan 0.3.x job: a config function for `-m torchtitan.train --module FILE --config plan3d_job`."""
    from plan3d.emit.torchtitan import DEFAULT_MODULE, emit_torchtitan
    from plan3d.plan import load_plan

    module = out.stem if out is not None and out.suffix == ".py" else DEFAULT_MODULE
    emitted = emit_torchtitan(load_plan(plan), compile=compile, module=module)
    if out is not None and out.suffix != ".py":
        emitted.notes.append(f"torchtitan imports the job as a Python module: name the file {module}.py")
    _write(emitted, out)


MasterAddrOpt = Annotated[str, typer.Option("--master-addr", help="Address of node 0 (a host name, or $VAR).")]
MasterPortOpt = Annotated[int, typer.Option("--master-port", help="Rendezvous port on node 0.")]
StepsOpt = Annotated[int, typer.Option("--steps", help="Training steps the runtime worker runs.")]
RunDirOpt = Annotated[str, typer.Option("--run-dir", help="Run directory on the nodes (shared file system).")]
TimeoutOpt = Annotated[float, typer.Option("--timeout-s", help="Collective and rendezvous timeout of the run.")]
DataOpt = Annotated[Optional[str], typer.Option("--data", help="Token file the nodes train on (or a bundled corpus, "
                                                "python-docs); default: synthetic tokens.")]


def _data_args(loaded, data: str | None) -> list[str]:
    """`--data` for the worker or launcher: checked when readable here, else noted (it lives on the nodes)."""
    from plan3d.launch import emitted_data

    if not data:
        return []
    note = emitted_data(loaded, data)
    if note:
        print(f"note: {note}", file=sys.stderr)
    return ["--data", data]


@emit_app.command("torchrun")
def emit_torchrun_cmd(plan: PlanArg, out: OutOpt = None, master_addr: MasterAddrOpt = "$MASTER_ADDR",
                      master_port: MasterPortOpt = 29500, steps: StepsOpt = 100, run_dir: RunDirOpt = "runs/job",
                      timeout_s: TimeoutOpt = 300.0, data: DataOpt = None) -> None:
    """One torchrun command line per node (static rendezvous, so the rank map holds)."""
    from plan3d.emit.common import Emitted
    from plan3d.emit.torchrun import torchrun_commands
    from plan3d.launch import worker_argv
    from plan3d.plan import load_plan
    from plan3d.run_flags import check_run_flags, check_script_flags, shell_line

    check_run_flags(steps=steps, master_port=master_port, timeout_s=timeout_s, master_addr=master_addr)
    check_script_flags(run_dir=run_dir, plan=plan, data=data)
    loaded = load_plan(plan)
    world, gpn = loaded.layout.world_size, loaded.gpus_per_node
    nnodes = -(-world // min(world, gpn))
    args = worker_argv(Path(run_dir), steps, "auto", ["--timeout-s", timeout_s, *_data_args(loaded, data)])
    commands = torchrun_commands(plan, world, nnodes, gpn, master_addr, master_port, args, python="python",
                                 rdzv_timeout_s=timeout_s)
    lines = [f"# node {node}\n{shell_line(cmd)}" for node, cmd in enumerate(commands)]
    _write(Emitted("\n".join(lines) + "\n"), out)


@emit_app.command("slurm")
def emit_slurm_cmd(
    plan: PlanArg, out: OutOpt = None, steps: StepsOpt = 100,
    run_dir: Annotated[str, typer.Option("--run-dir", help="Run directory (shared file system).")] = "runs/slurm-$SLURM_JOB_ID",
    master_port: MasterPortOpt = 29500,
    job_name: Annotated[str, typer.Option("--job-name", help="Letters, digits, '.', '_', '-'.")] = "plan3d",
    time_limit: Annotated[str, typer.Option("--time", help="SLURM time limit: HH:MM:SS, MM, D-HH:MM:SS, ...")] = "01:00:00",
    partition: Annotated[Optional[str], typer.Option("--partition")] = None,
    timeout_s: TimeoutOpt = 300.0, data: DataOpt = None,
    cpus_per_task: Annotated[Optional[int], typer.Option(
        "--cpus-per-task", help="Cores for each node's launcher (it starts all the node's ranks); default: the "
        "cluster spec's cpu_cores_per_node, else every CPU SLURM allocates on the node (--exclusive).")] = None,
) -> None:
    """An sbatch script: one `plan3d launch` per node on whole nodes, static rendezvous, the plan's placement."""
    from plan3d.emit.common import Emitted
    from plan3d.emit.slurm import sbatch_script
    from plan3d.plan import load_plan
    from plan3d.run_flags import check_run_flags, check_script_flags

    check_run_flags(steps=steps, master_port=master_port, timeout_s=timeout_s)
    check_script_flags(job_name=job_name, time_limit=time_limit, partition=partition, cpus_per_task=cpus_per_task,
                       run_dir=run_dir, plan=plan, data=data)
    loaded = load_plan(plan)
    script = sbatch_script(loaded, plan, steps=steps, run_dir=run_dir, master_port=master_port,
                           job_name=job_name, time_limit=time_limit, partition=partition,
                           extra_args=["--timeout-s", str(timeout_s), *_data_args(loaded, data)],
                           cpus_per_task=cpus_per_task)
    _write(Emitted(script), out)
