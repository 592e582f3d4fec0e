"""Rich output for `plan3d report` (measured vs predicted) and `plan3d calibrate` (fitted vs catalog)."""
from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Callable

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from plan3d.render.units import gib, ms, printable
from plan3d.vocab import TIME_TERMS

# The rows of the predicted step breakdown: every time term, the host overhead included, so that
# the rows add up to the predicted step (its last row).
BREAKDOWN_TERMS = TIME_TERMS
TIME_LABELS = {"compute": "compute", "recompute": "recompute", "bubble": "pipeline bubble",
               "tp_comm": "TP comm", "pp_comm": "PP comm", "ep_comm": "EP all-to-all (exposed)",
               "offload": "activation offload (exposed)", "overhead": "host overhead (kernel launches)", "dp_comm": "DP comm (exposed)",
               "zero_comm": "ZeRO-3 gathers (exposed)", "optimizer": "optimizer step"}
# How a prediction error is coloured, in the table and in `report --plot`'s bars: (largest |error|,
# rich colour, matplotlib colour); `ERROR_LEGEND` says it under the table.
ERROR_COLOURS = ((0.15, "green", "tab:green"), (0.30, "yellow", "gold"), (float("inf"), "red", "tab:red"))


def _plain(text: str) -> str:
    """Text from a run directory or a path, shown as written: one line, no rich markup."""
    return escape(printable(text))


def fmt(value, unit: str) -> str:
    """An SI value in the unit people read: ms, GiB, GB/s, GFLOP/s, %."""
    if value is None:
        return "-"
    if unit == "s":
        return ms(value) if value >= 1e-3 else f"{value * 1e6:.1f} us"
    if unit == "bytes":
        return gib(value) if value >= 2**30 else f"{value / 2**20:.1f} MiB"
    if unit == "bytes_per_s":
        return f"{value / 1e9:.2f} GB/s"
    if unit in ("flops", "flops_per_s"):
        return _si(value, "FLOP" if unit == "flops" else "FLOP/s")
    if unit == "ratio":
        return f"{value:.3g}" if value > 1.5 else f"{value:.1%}"
    if unit == "tokens_per_s":
        return f"{value:,.0f}"
    return f"{value:.4g}"


def _si(value: float, unit: str) -> str:
    for prefix, size in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(value) >= size:
            return f"{value / size:.3g} {prefix}{unit}"
    return f"{value:.3g} {unit}"


def report_table(report) -> Table:
    table = Table(title=f"measured vs predicted: {report.layout} ({_plain(report.run_dir)})")
    for name, justify in (("term", "left"), ("predicted", "right"), ("measured", "right"),
                          ("prediction error", "right")):
        table.add_column(name, justify=justify)
    for r in report.rows:
        error = error_text(r["error"])
        table.add_row(r["term"], fmt(r["predicted"], r["unit"]), fmt(r["measured"], r["unit"]), error)
    return table


def error_colour(error: float, plot: bool = False) -> str:
    """The colour of a prediction error (`ERROR_COLOURS`): rich's, or matplotlib's for the plot."""
    return next(c[2 if plot else 1] for c in ERROR_COLOURS if abs(error) <= c[0])


def error_legend(plot: bool = False) -> list[tuple[str, str]]:
    """(colour, 'within +-15%') per `ERROR_COLOURS` row: the legend of the colours."""
    out, below = [], 0.0
    for limit, rich_colour, plot_colour in ERROR_COLOURS:
        what = f"within +-{limit:.0%}" if not below else (f"+-{below:.0%} to +-{limit:.0%}" if limit != float("inf")
                                                          else f"beyond +-{below:.0%}")
        out.append((plot_colour if plot else rich_colour, what))
        below = limit
    return out


def legend_line() -> str:
    """'prediction error (predicted / measured - 1): green within +-15%, yellow ..., red beyond +-30%'."""
    parts = [f"[{c}]{c}[/{c}] {escape(what)}" for c, what in error_legend()]
    return "prediction error (predicted / measured - 1): " + ", ".join(parts)


def error_text(error: float | None) -> str:
    """A prediction error as a signed, coloured percentage ('-' when there is none)."""
    if error is None:
        return "-"
    colour = error_colour(error)
    return f"[{colour}]{error:+.1%}[/{colour}]"


def breakdown_table(time_s: dict) -> Table:
    """Every predicted time term and its share, and their sum: the predicted step."""
    table = Table(title="predicted step breakdown")
    table.add_column("term")
    table.add_column("time", justify="right")
    table.add_column("share", justify="right")
    total = sum(time_s.values())
    for key in BREAKDOWN_TERMS:
        if key in time_s:
            table.add_row(TIME_LABELS[key], fmt(time_s[key], "s"), f"{time_s[key] / (total or 1.0):.1%}")
    table.add_section()
    table.add_row("predicted step", fmt(total, "s"), "100.0%")
    return table


def _resumed(segment: dict) -> str:
    if not segment.get("resumed_at_step"):
        return "from the start"
    return f"resumed from step {segment['resumed_at_step']}"


def segment_line(number: int, segment: dict) -> str:
    """One launch of the run: its steps, where it resumed, its layout and its own timing."""
    last = segment.get("last_step")
    steps = f"steps {segment['first_step']}..{last}" if last is not None else "no step"
    ranks = segment.get("world_size")
    parts = [f"segment {number}: {steps} ({_resumed(segment)})",
             f"{segment.get('layout') or '?'}" + (f" on {ranks} rank{'s' if ranks != 1 else ''}" if ranks else ""),
             f"{fmt(segment.get('step_time_s'), 's')}/step (predicted {fmt(segment.get('predicted_step_time_s'), 's')})",
             f"{fmt(segment.get('tokens_per_s'), 'tokens_per_s')} tokens/s"]
    if segment.get("final_loss") is not None:
        parts.append(f"final loss {segment['final_loss']:.4f}")
    return ", ".join(parts) + f", {segment.get('ended') or '?'}"


def print_segments(segments: list[dict], console: Console) -> None:
    console.print(f"[bold]{len(segments)} launches (segments)[/bold]")
    for number, segment in enumerate(segments, 1):
        console.print(_plain(segment_line(number, segment)), highlight=False)


def print_report(report, console: Console | None = None) -> None:
    console = console or Console()
    if len(report.segments) > 1:
        print_segments(report.segments, console)
    console.print(report_table(report))
    console.print(legend_line())
    if report.predicted_time_s:
        console.print(breakdown_table(report.predicted_time_s))
    for note in report.notes:
        console.print(f"[dim]note: {_plain(note)}[/dim]")


def print_calibration(rows: list[dict], spec: Path, measurements: Path | None, console: Console | None = None) -> None:
    console = console or Console()
    table = Table(title="calibration: fitted vs catalog")
    for name, justify in (("scope", "left"), ("quantity", "left"), ("catalog", "right"), ("fitted", "right")):
        table.add_column(name, justify=justify)
    for r in rows:
        table.add_row(r["scope"], r["quantity"], fmt(r["catalog"], r["unit"]), fmt(r["fitted"], r["unit"]))
    console.print(table)
    console.print(f"wrote {spec}" + (f" (raw measurements: {measurements})" if measurements else ""))
    console.print(f"use it: plan3d estimate --cluster {spec} ...")


def progress_while(work: Callable[[], None], progress_file: Path, description: str, poll_s: float = 0.2) -> None:
    """Run `work()` while a progress bar follows `progress_file` ('done total'); re-raise its error."""

    failure: list[BaseException] = []

    def target() -> None:
        try:
            work()
        except BaseException as err:  # noqa: BLE001 - handed back to the caller's thread
            failure.append(err)

    thread = threading.Thread(target=target, daemon=True)
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), transient=True, console=Console(stderr=True)) as bar:
        task = bar.add_task(description, total=None)
        thread.start()
        while thread.is_alive():
            _update(bar, task, progress_file)
            time.sleep(poll_s)
    thread.join()
    if failure:
        raise failure[0]


def _update(bar, task, progress_file: Path) -> None:
    try:
        done, total = (int(v) for v in progress_file.read_text().split())
    except (OSError, ValueError):
        return
    bar.update(task, completed=done, total=total)
