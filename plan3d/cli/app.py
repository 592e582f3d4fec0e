"""The typer application object that every command module registers on."""
from __future__ import annotations

import typer

app = typer.Typer(
    name="plan3d",
    help="Plan, check and launch 3D-parallel (TP x PP x DP, ZeRO) training layouts.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
specs_app = typer.Typer(help="The bundled catalog of GPUs, clusters and models; spec schemas.",
                        no_args_is_help=True)
app.add_typer(specs_app, name="specs")
