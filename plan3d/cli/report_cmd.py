"""`plan3d report RUN_DIR [--cluster SPEC] [--json] [--plot FILE]`: measured vs predicted per term."""
from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from plan3d.cli.app import app
from plan3d.render.units import json_text


@app.command("report")
def report_command(
    run_dir: Annotated[Path, typer.Argument(help="A run directory written by `plan3d launch`.")],
    cluster: Annotated[Optional[str], typer.Option("--cluster", "-c", help="Predict with this cluster spec "
                                                   "(e.g. one from `plan3d calibrate`) instead of the plan's estimate.")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print JSON instead of tables.")] = False,
    plot: Annotated[Optional[Path], typer.Option("--plot", help="Write a measured-vs-predicted picture (PNG/SVG/PDF).")] = None,
) -> None:
    """Show, per term, what the plan predicted and what the run measured."""
    from plan3d.run.compare import compare
    from plan3d.run.record import read_run

    spec = None
    if cluster is not None:
        from plan3d.specs.catalog import load_cluster

        spec = load_cluster(cluster)
    report = compare(read_run(run_dir), spec)
    if plot is not None:
        from plan3d.render.plots import plot_report

        plot_report(report.to_dict(), plot)
    if json_out:
        print(json_text(report.to_dict()))
        return
    from plan3d.render.report import print_report

    print_report(report)
    if plot is not None:
        print(f"wrote {plot}")
