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

PlanArg = Annotated[str, typer.Argument(help="A plan.json written by `plan3d plan`/`recommend --save`.")]
OutOpt = Annotated[Optional[Path], typer.Option("--output", "-o", help="Write here instead of stdout.")]


def _write(emitted, out: Path | None) -> None:
    for note in emitted.notes:
        print(f"note: {note}", file=sys.stderr)
    if out is None:
        sys.stdout.write(emitted.text)
        return
    out.write_text(emitted.text)
    print(f"wrote {out}", file=sys.stderr)


@emit_app.command("megatron")
def emit_megatron_cmd(plan: PlanArg, out: OutOpt = None) -> None:
    """Megatron-LM arguments (parallel sizes, batch, recompute, distributed optimizer, model shape)."""
    from plan3d.emit.megatron import emit_megatron
    from plan3d.plan import load_plan

    _write(emit_megatron(load_plan(plan)), out)


@emit_app.command("deepspeed")
def emit_deepspeed_cmd(plan: PlanArg, out: OutOpt = None) -> None:
    """A DeepSpeed ds_config.json (ZeRO stage, micro-batch, accumulation, precision, AutoTP)."""
    from plan3d.emit.deepspeed import emit_deepspeed
    from plan3d.plan import load_plan

    _write(emit_deepspeed(load_plan(plan)), out)


@emit_app.command("torchtitan")
def emit_torchtitan_cmd(plan: PlanArg, out: OutOpt = None) -> None:
    """torchtitan TOML sections: [parallelism], [training], [activation_checkpoint]."""
    from plan3d.emit.torchtitan import emit_torchtitan
    from plan3d.plan import load_plan

    _write(emit_torchtitan(load_plan(plan)), out)


@emit_app.command("torchrun")
def emit_torchrun_cmd(plan: PlanArg, out: OutOpt = None) -> None:
    """One torchrun command line per node (static rendezvous, so the rank map holds)."""
    from plan3d.emit.megatron import Emitted
    from plan3d.emit.torchrun import torchrun_commands
    from plan3d.plan import load_plan

    commands = torchrun_commands(load_plan(plan), plan)
    text = commands if isinstance(commands, str) else "\n".join(_as_line(c) for c in commands) + "\n"
    _write(Emitted(text), out)


@emit_app.command("slurm")
def emit_slurm_cmd(plan: PlanArg, out: OutOpt = None) -> None:
    """An sbatch script that starts the plan on the cluster's nodes."""
    from plan3d.emit.megatron import Emitted
    from plan3d.emit.slurm import sbatch_script
    from plan3d.plan import load_plan

    _write(Emitted(sbatch_script(load_plan(plan), plan)), out)


def _as_line(command) -> str:
    import shlex

    return command if isinstance(command, str) else shlex.join(command)
