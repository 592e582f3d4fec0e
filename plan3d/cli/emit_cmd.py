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


DataPathOpt = Annotated[Optional[str], typer.Option("--data-path", help="Megatron dataset prefix (.bin/.idx), "
                                                   "or 'mock' for synthetic tokens; default: required as DATA_PATH.")]
TokenizerOpt = Annotated[Optional[str], typer.Option("--tokenizer", help="Hugging Face tokenizer name or path, or "
                                                     "'null' (the model's vocabulary, for mock data); default: "
                                                     "required as TOKENIZER.")]
TrainItersOpt = Annotated[Optional[int], typer.Option("--train-iters", help="Training iterations (torchtitan: "
                                                      "steps); default: required as TRAIN_ITERS (TRAIN_STEPS).")]
LrOpt = Annotated[Optional[float], typer.Option("--lr", help="Peak learning rate; default: required as LR.")]


def _megatron_run(data_path, tokenizer, train_iters, lr):
    from plan3d.emit.megatron import MegatronRun, check_megatron_run

    run = MegatronRun(data_path=data_path, tokenizer=tokenizer, train_iters=train_iters, lr=lr)
    check_megatron_run(run)
    return run


@emit_app.command("megatron")
def emit_megatron_cmd(plan: PlanArg, out: OutOpt = None, data_path: DataPathOpt = None, tokenizer: TokenizerOpt = None,
                      train_iters: TrainItersOpt = None, lr: LrOpt = None) -> None:
    """A Megatron-Core 0.17-0.19 job script to run on every node: `torchrun ... pretrain_gpt.py` with the
    plan's parallel sizes, ZeRO (distributed optimizer, Megatron-FSDP), overlap, batch, recompute and the
    model as its spec defines it; data, tokenizer and schedule from the flags, else required from the
    environment (as MEGATRON_LM, a Megatron-LM checkout)."""
    from plan3d.emit.megatron import emit_megatron
    from plan3d.plan import load_plan

    run = _megatron_run(data_path, tokenizer, train_iters, lr)
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
EngineOpt = Annotated[Optional[str], typer.Option(
    "--engine", help="The engine profile the script starts: megatron-core (Megatron-LM's pretrain_gpt.py), "
    "torchtitan / torchtitan-compile (torchtitan.train), deepspeed-0.19 (your DeepSpeed script, TRAIN_SCRIPT) or "
    "plan3d-runtime (plan3d's bundled runtime); default: the plan's engine, else plan3d-runtime.")]


def _data_args(loaded, data: str | None) -> list[str]:
    """`--data` for the worker or launcher: checked when readable here, else noted (it lives on the nodes)."""
    from plan3d.run.launch import emitted_data

    if not data:
        return []
    note = emitted_data(loaded, data)
    if note:
        print(f"note: {note}", file=sys.stderr)
    return ["--data", data]


def _engine_job(loaded, engine, data_path, tokenizer, train_iters, lr):
    """(JobScript, notes) of the engine the script starts, or None for plan3d's runtime."""
    from plan3d.emit.launchers import choose_engine, engine_job

    choice = choose_engine(loaded, engine)
    if choice.note:
        print(f"note: {choice.note}", file=sys.stderr)
    if choice.launcher == "runtime":
        return None
    titan = choice.launcher == "torchtitan"
    given = {"--data-path": data_path, "--tokenizer": None if titan and tokenizer != "null" else tokenizer, "--lr": lr,
             "--train-iters": None if titan else train_iters}
    unused = [flag for flag, value in given.items() if value is not None and choice.launcher != "megatron"]
    if unused:
        print(f"note: {', '.join(unused)} not used: {choice.engine} takes them from its own config (torchtitan: the "
              "recipe in the job module; DeepSpeed: your TRAIN_SCRIPT); pass overrides after the script's name",
              file=sys.stderr)
    return engine_job(loaded, choice, _megatron_run(data_path, tokenizer, train_iters, lr))


@emit_app.command("torchrun")
def emit_torchrun_cmd(plan: PlanArg, out: OutOpt = None, engine: EngineOpt = None,
                      master_addr: MasterAddrOpt = "$MASTER_ADDR",
                      master_port: MasterPortOpt = 29500, steps: StepsOpt = 100, run_dir: RunDirOpt = "runs/job",
                      timeout_s: TimeoutOpt = 300.0, data: DataOpt = None, data_path: DataPathOpt = None,
                      tokenizer: TokenizerOpt = None, train_iters: TrainItersOpt = None, lr: LrOpt = None) -> None:
    """What each node runs, with the static rendezvous (so the rank map holds): for an engine, a job script
    to run on every node (megatron-core: as `emit megatron`; torchtitan: the job module written into the
    run directory; DeepSpeed: your TRAIN_SCRIPT with the plan's ds_config.json); plan3d-runtime: one
    torchrun command line per node (--steps, --run-dir, --timeout-s, --data are its options)."""
    from plan3d.emit.common import Emitted
    from plan3d.emit.torchrun import torchrun_commands
    from plan3d.run.launch import worker_argv
    from plan3d.plan import load_plan
    from plan3d.run.flags import check_run_flags, check_script_flags, shell_line

    loaded = load_plan(plan)
    engine_job = _engine_job(loaded, engine, data_path, tokenizer, train_iters, lr)
    if engine_job is not None:
        from plan3d.emit.launch_script import node_script

        job, notes = engine_job
        _write(Emitted(node_script(loaded, job), notes), out)
        return
    check_run_flags(steps=steps, master_port=master_port, timeout_s=timeout_s, master_addr=master_addr)
    check_script_flags(run_dir=run_dir, plan=plan, data=data)
    world, gpn = loaded.layout.world_size, loaded.gpus_per_node
    nnodes = -(-world // min(world, gpn))
    args = worker_argv(Path(run_dir), steps, "auto", ["--timeout-s", timeout_s, *_data_args(loaded, data)])
    commands = torchrun_commands(plan, world, nnodes, gpn, master_addr, master_port, args, python="python",
                                 rdzv_timeout_s=timeout_s)
    lines = [f"# node {node}\n{shell_line(cmd)}" for node, cmd in enumerate(commands)]
    _write(Emitted("\n".join(lines) + "\n"), out)


@emit_app.command("slurm")
def emit_slurm_cmd(
    plan: PlanArg, out: OutOpt = None, engine: EngineOpt = None, steps: StepsOpt = 100,
    run_dir: Annotated[str, typer.Option("--run-dir", help="Run directory (shared file system).")] = "runs/slurm-$SLURM_JOB_ID",
    master_port: MasterPortOpt = 29500,
    job_name: Annotated[str, typer.Option("--job-name", help="Letters, digits, '.', '_', '-'.")] = "plan3d",
    time_limit: Annotated[str, typer.Option("--time", help="SLURM time limit: HH:MM:SS, MM, D-HH:MM:SS, ...")] = "01:00:00",
    partition: Annotated[Optional[str], typer.Option("--partition")] = None,
    timeout_s: TimeoutOpt = 300.0, data: DataOpt = None,
    cpus_per_task: Annotated[Optional[int], typer.Option(
        "--cpus-per-task", help="Cores for each node's launcher (it starts all the node's ranks); default: the "
        "cluster spec's cpu_cores_per_node, else every CPU SLURM allocates on the node (--exclusive).")] = None,
    data_path: DataPathOpt = None, tokenizer: TokenizerOpt = None, train_iters: TrainItersOpt = None,
    lr: LrOpt = None,
) -> None:
    """An sbatch script on whole nodes, one launcher per node with the static rendezvous (the plan's
    placement), starting the engine (the job script of `emit torchrun --engine E`, RUN_DIR and the run
    settings from the environment or the flags) or one `plan3d launch` per node (plan3d-runtime)."""
    from plan3d.emit.common import Emitted
    from plan3d.emit.slurm import engine_sbatch_script, sbatch_script
    from plan3d.plan import load_plan
    from plan3d.run.flags import check_run_flags, check_script_flags

    loaded = load_plan(plan)
    engine_job = _engine_job(loaded, engine, data_path, tokenizer, train_iters, lr)
    if engine_job is not None:
        job, notes = engine_job
        _write(Emitted(engine_sbatch_script(loaded, job, job_name=job_name, time_limit=time_limit,
                                            partition=partition, cpus_per_task=cpus_per_task), notes), out)
        return
    check_run_flags(steps=steps, master_port=master_port, timeout_s=timeout_s)
    check_script_flags(job_name=job_name, time_limit=time_limit, partition=partition, cpus_per_task=cpus_per_task,
                       run_dir=run_dir, plan=plan, data=data)
    script = sbatch_script(loaded, plan, steps=steps, run_dir=run_dir, master_port=master_port,
                           job_name=job_name, time_limit=time_limit, partition=partition,
                           extra_args=["--timeout-s", str(timeout_s), *_data_args(loaded, data)],
                           cpus_per_task=cpus_per_task)
    _write(Emitted(script), out)
