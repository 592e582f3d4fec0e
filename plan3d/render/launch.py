"""Rendering for `plan3d launch`: a live progress bar, then what the run did and the table of
`plan3d report` (one renderer: render/report.py `print_report`, fed by plan3d/run/compare.py)."""
from __future__ import annotations

from contextlib import contextmanager

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from plan3d.render.report import print_report
from plan3d.render.units import ms, printable


@contextmanager
def progress_bar(steps: int, first_step: int = 1, console: Console | None = None):
    """Yields on_progress(record) that advances a bar showing loss and step time."""
    bar = Progress(TextColumn("[bold]step"), MofNCompleteColumn(), BarColumn(),
                   TextColumn("loss {task.fields[loss]}"), TextColumn("{task.fields[step_ms]}"),
                   TimeElapsedColumn(), console=console or Console(stderr=True), transient=False)
    with bar:
        task = bar.add_task("train", total=steps, completed=first_step - 1, loss="-", step_ms="")

        def on_progress(record: dict) -> None:
            bar.update(task, completed=record["step"], loss=f"{record['loss']:.4f}",
                       step_ms=ms(record["step_time_s"]))

        yield on_progress


def print_run(summary: dict, run_dir: str, console: Console) -> None:
    """The losses of the run, its data and where it lies (what `plan3d report` does not show)."""
    losses = ", ".join(f"{x:.4f}" for x in summary.get("losses") or [])
    first, steps = summary.get("first_step", 1), summary.get("steps") or 0
    console.print(f"losses (steps {first}..{first + steps - 1}): {losses}", highlight=False)
    data = summary.get("data") or {}
    if data.get("path"):
        console.print(escape(printable(f"data: {data['path']} ({data['tokens']:,} tokens, {data['format']})")),
                      highlight=False)
    console.print(escape(printable(f"run directory: {run_dir} (metrics.jsonl, summary.json, logs/)")), highlight=False)


def print_launch_end(summary: dict, comparison, run_dir: str, console: Console | None = None) -> None:
    """The end of `plan3d launch`: the run, then exactly what `plan3d report RUN_DIR` prints."""
    console = console or Console()
    print_run(summary, run_dir, console)
    print_report(comparison, console)
