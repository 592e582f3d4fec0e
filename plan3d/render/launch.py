"""Rendering for `plan3d launch`: a live progress bar, then measured against predicted."""
from __future__ import annotations

from contextlib import contextmanager

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from plan3d.render.report import error_text
from plan3d.render.units import GIB, ms
from plan3d.report_run import prediction_error


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


def _mib(n: float | None) -> str:
    return "-" if n is None else f"{n / 2**20:.2f} MiB" if n < GIB else f"{n / GIB:.2f} GiB"


def comparison_rows(summary: dict, predicted_state: dict[int, float]) -> list[tuple[str, float | None, float | None, str]]:
    """(quantity, measured, predicted, unit) rows: step time, then per-rank memory."""
    pred = summary.get("predicted", {})
    rows = [("step time (mean after warm-up)", summary["step_time_s"], pred.get("step_time_s"), "s")]
    phases, time_s = summary.get("phases_s") or {}, pred.get("time_s") or {}
    if phases and time_s:
        from plan3d.report_run import PHASES

        for label, measured_keys, predicted_keys in PHASES:
            rows.append((f"  {label}", sum(phases.get(k, 0.0) for k in measured_keys),
                         sum(time_s.get(k, 0.0) for k in predicted_keys), "s"))
    for r in summary["ranks"]:
        rows.append((f"rank {r['rank']} (pp {r['pp']}) model states", r["model_state_bytes"].get("total"),
                     predicted_state.get(r["pp"]), "B"))
    peak = max(r["peak_memory_bytes"] for r in summary["ranks"])
    rows.append(("peak memory (max over ranks)", peak, pred.get("peak_memory_bytes"), "B"))
    return rows


def print_summary(summary: dict, predicted_state: dict[int, float], run_dir: str, console: Console | None = None,
                  notes: list[str] = ()) -> None:
    console = console or Console()
    losses = ", ".join(f"{x:.4f}" for x in summary["losses"])
    console.print(f"losses (steps {summary['first_step']}..{summary['first_step'] + summary['steps'] - 1}): {losses}")
    segments = summary.get("segments") or []
    if len(segments) > 1:
        from plan3d.render.report import print_segments

        print_segments(segments, console)
    data = summary.get("data") or {}
    if data.get("path"):
        console.print(f"data: {data['path']} ({data['tokens']:,} tokens, {data['format']})")
    table = Table(title=f"measured vs predicted ({summary['world_size']} ranks, {summary['backend']}, "
                        f"{summary['precision']})")
    for col in ("", "predicted", "measured", "prediction error"):  # the columns and sign of `plan3d report`
        table.add_column(col, justify="left" if not col else "right")
    for name, measured, predicted, unit in comparison_rows(summary, predicted_state):
        show = ms if unit == "s" else _mib
        table.add_row(name, show(predicted) if predicted is not None else "-",
                      show(measured) if measured is not None else "-",
                      error_text(prediction_error(predicted, measured)))
    console.print(table)
    from plan3d.specs.catalog import RUNTIME_ENGINE

    console.print(f"predicted for the engine {summary.get('predicted', {}).get('engine') or RUNTIME_ENGINE} "
                  "(plan3d's own runtime, which trained this run)")
    for note in notes:
        console.print(note)
    console.print(f"run directory: {run_dir} (metrics.jsonl, summary.json, logs/)")
