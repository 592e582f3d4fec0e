"""Pictures (matplotlib, imported lazily; `pip install plan3d[plot]`). Each writes one file.

    plot_pareto(points, path)             recommend --plot: throughput vs memory, the front and the pick marked
    plot_step_breakdown(estimate, path)   estimate --plot: the layout, its step and its memory against capacity
    plot_report(report, path)             report --plot: measured vs predicted per term, coloured by error

Each picture states its answer in words as well as in shapes: the chosen layout by name, and
whether it fits ("94.3 GiB of 76.0 GiB usable: does not fit"). `pareto_figure` and `step_figure`
return the figure unsaved, so tests read its texts instead of its pixels.

The file type follows the suffix (.png, .svg, .pdf). Inputs are plain dicts in SI units, so the
callers pass `Estimate.to_dict()` or `Report.to_dict()` and nothing here knows the cost model.
"""
from __future__ import annotations

import string
from pathlib import Path

from plan3d.errors import Plan3dError
from plan3d.layout import Layout
from plan3d.render.estimate import MEMORY_LABELS, TIME_LABELS
from plan3d.render.report import error_colour, error_legend
from plan3d.render.units import count, gib
from plan3d.vocab import MEMORY_TERMS, TIME_TERMS
GIB = 2**30
MAX_FRONT_LABELS = 8
LABEL_SPACING_PX = 28  # front points closer than this on screen share no letter (no piled-up labels)
FIT_COLOURS = {True: "tab:green", False: "tab:red"}


def _pyplot():
    try:
        import matplotlib  # lazy: an optional extra (plan3d[plot]), and slow to import
    except ImportError:
        raise Plan3dError("--plot needs matplotlib: pip install 'plan3d[plot]'") from None
    matplotlib.use("Agg")  # files only, never a window
    import matplotlib.pyplot as plt  # lazy: see _pyplot

    return plt


def _save(fig, path: Path) -> None:
    path = Path(path)
    import matplotlib.pyplot as plt  # lazy: see _pyplot

    if path.suffix.lower() not in (".png", ".svg", ".pdf"):
        plt.close(fig)
        raise Plan3dError(f"--plot {path}: use a .png, .svg or .pdf file name")
    fig.savefig(path, dpi=130, bbox_inches="tight")
    plt.close(fig)


def pareto_front(points: list[dict]) -> list[int]:
    """Indices of the points no other point beats on both throughput (higher) and memory (lower)."""
    order = sorted(range(len(points)), key=lambda i: (points[i]["peak_memory_bytes"], -points[i]["tokens_per_s"]))
    front, best = [], float("-inf")
    for i in order:
        if points[i]["tokens_per_s"] > best:
            front.append(i)
            best = points[i]["tokens_per_s"]
    return front


# ---- recommend --plot ----------------------------------------------------------------------
def plot_pareto(points: list[dict], path: Path, capacity_bytes: float | None = None, chosen: int | None = 0) -> None:
    """Write `pareto_figure` to `path`."""
    _save(pareto_figure(points, capacity_bytes, chosen), path)


def pareto_figure(points: list[dict], capacity_bytes: float | None = None, chosen: int | None = 0):
    """Scatter of feasible layouts: x peak memory (GiB), y tokens/s; the Pareto front joined and
    lettered (the letters keyed by layout at the right), the chosen layout starred and named.

    Each point: {'tokens_per_s', 'peak_memory_bytes', optional 'label', optional 'pareto': bool}
    (without 'pareto' the front is computed here). `chosen` indexes the layout the command picked;
    `pareto_points` lists points in rank order, so the default 0 is the #1 layout."""
    if not points:
        raise Plan3dError("nothing to plot: no feasible layout")
    plt = _pyplot()
    fig, (ax, key_ax) = plt.subplots(1, 2, figsize=(11, 5), gridspec_kw={"width_ratios": [2.4, 1]})
    front = _front_by_memory(points)
    ax.scatter([_gib(p) for p in points], [p["tokens_per_s"] for p in points],
               s=12, alpha=0.5, color="tab:gray", label="feasible layouts")
    ax.plot([_gib(points[i]) for i in front], [points[i]["tokens_per_s"] for i in front],
            "o-", color="tab:red", markersize=4, label="Pareto front")
    if capacity_bytes:
        ax.axvline(capacity_bytes / GIB, color="tab:blue", linestyle="--", label=f"usable memory {gib(capacity_bytes)}")
    if chosen is not None:
        _mark_chosen(ax, points, chosen)
    ax.set(xlabel="peak memory of the most-loaded GPU (GiB)", ylabel="tokens/s", title="throughput vs memory")
    ax.margins(x=0.08, y=0.1)
    lettered = _letter_front(ax, points, front, chosen)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=2, frameon=False)  # off the points
    _front_key(key_ax, points, lettered, chosen)
    fig.tight_layout()
    return fig


def _gib(point: dict) -> float:
    return point["peak_memory_bytes"] / GIB


def _front_by_memory(points: list[dict]) -> list[int]:
    marked = [i for i, p in enumerate(points) if p.get("pareto")] if any("pareto" in p for p in points) \
        else pareto_front(points)
    return sorted(marked, key=lambda i: points[i]["peak_memory_bytes"])


def chosen_text(points: list[dict], chosen: int) -> str:
    """'chosen #1: tp2 pp1 ... (68.7K tokens/s, 60.1 GiB)' -- the legend entry of the starred point."""
    point = points[chosen]
    name = point.get("label") or "(not on the front)"
    return f"chosen #{point.get('rank', chosen + 1)}: {name} ({count(point['tokens_per_s'])} tokens/s, {gib(point['peak_memory_bytes'])})"


def _mark_chosen(ax, points: list[dict], chosen: int) -> None:
    point = points[chosen]
    ax.scatter([_gib(point)], [point["tokens_per_s"]], marker="*", s=260, color="gold", edgecolor="black",
               zorder=5, label=chosen_text(points, chosen))


def _letter_front(ax, points: list[dict], front: list[int], chosen: int | None) -> dict[str, int]:
    """Letter a spread of front points, below and right of each (clear of a rising front line).

    The chosen layout's star is its label: it gets no letter, and front points crowding it none."""
    picked = _spread_on_screen(ax, points, front, reserved=chosen)
    lettered = dict(zip(string.ascii_uppercase, sorted(picked, key=lambda i: points[i]["peak_memory_bytes"])))
    for letter, i in lettered.items():
        ax.annotate(letter, (_gib(points[i]), points[i]["tokens_per_s"]), xytext=(5, -13), textcoords="offset points",
                    fontsize=8, fontweight="bold", color="tab:red", gid=f"front-label-{letter}")
    return lettered


def _spread_on_screen(ax, points: list[dict], front: list[int], reserved: int | None) -> list[int]:
    """Up to MAX_FRONT_LABELS labelled front points, each at least LABEL_SPACING_PX on screen from
    the others and from the `reserved` point."""
    ax.figure.canvas.draw()  # fixes the axis limits, so screen distances are final

    def screen(i: int):
        return ax.transData.transform((_gib(points[i]), points[i]["tokens_per_s"]))

    taken = [screen(reserved)] if reserved is not None else []
    picked = []
    for i in front:
        xy = screen(i)
        crowded = any(((xy - other) ** 2).sum() ** 0.5 < LABEL_SPACING_PX for other in taken)
        if i != reserved and points[i].get("label") and not crowded and len(picked) < MAX_FRONT_LABELS:
            picked.append(i)
            taken.append(xy)
    return picked


def _front_key(key_ax, points: list[dict], lettered: dict[str, int], chosen: int | None) -> None:
    """The right-hand panel: the chosen layout, then each front letter with its layout, memory, throughput."""
    key_ax.axis("off")
    lines = []
    if chosen is not None:
        lines += [f"*  {chosen_text(points, chosen)}".replace(" (", "\n   (", 1), ""]
    lines.append("Pareto front, lightest first:")
    for letter, i in lettered.items():
        lines.append(f"{letter}  {points[i]['label']}\n   {gib(points[i]['peak_memory_bytes'])}, "
                     f"{count(points[i]['tokens_per_s'])} tokens/s")
    if not lettered:
        lines.append("(no other front layout to label)")
    key_ax.text(0, 1, "\n".join(lines), va="top", ha="left", fontsize=7.5, family="monospace",
                transform=key_ax.transAxes, gid="front-key")


# ---- estimate --plot -----------------------------------------------------------------------
def plot_step_breakdown(estimate: dict, path: Path, title: str | None = None) -> None:
    """Write `step_figure` to `path`."""
    _save(step_figure(estimate, title), path)


def step_figure(estimate: dict, title: str | None = None):
    """Two stacked bars for one layout: the step's time terms, and the most-loaded GPU's memory
    against the usable capacity, with the verdict in words. `title` (e.g. model and cluster) leads."""
    plt = _pyplot()
    fig, (time_ax, mem_ax) = plt.subplots(2, 1, figsize=(10, 5))
    layout = Layout(**estimate["layout"]).short()
    fig.suptitle(f"{title}: {layout}" if title else layout, fontsize=11, fontweight="bold")
    _time_bar(time_ax, estimate)
    _memory_bar(mem_ax, estimate)
    fig.tight_layout()
    return fig


def _stacked_bar(ax, values: list[tuple[str, float]], scale: float, unit) -> None:
    left = 0.0
    for label, value in values:
        if value > 0:
            ax.barh([0], [value / scale], left=left, label=f"{label} {unit(value)}")
            left += value / scale
    ax.set_yticks([])


def _legend_beside(ax) -> None:
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False)


def _time_bar(ax, estimate: dict) -> None:
    time_s = estimate["time_s"]
    _stacked_bar(ax, [(TIME_LABELS[key], time_s.get(key, 0.0)) for key in TIME_TERMS], 1.0, _seconds)
    _legend_beside(ax)
    mfu = f", MFU {estimate['mfu']:.0%}" if estimate.get("mfu") is not None else ""
    ax.set(xlabel="seconds per step",
           title=f"predicted step {_seconds(estimate['step_time_s'])} ({count(estimate['tokens_per_s'])} tokens/s{mfu})")


def fit_text(estimate: dict) -> str:
    """'94.3 GiB of 76.0 GiB usable: does not fit' for the most-loaded GPU."""
    verdict = "fits" if estimate["fits"] else "does not fit"
    return f"{gib(estimate['peak_memory_bytes'])} of {gib(estimate['capacity_bytes'])} usable: {verdict}"


def _memory_bar(ax, estimate: dict) -> None:
    memory = estimate["memory_bytes"]
    capacity = estimate["capacity_bytes"]
    ax.axvline(capacity / GIB, color="black", linestyle="--", linewidth=1.5, label=f"usable {gib(capacity)}")
    _stacked_bar(ax, [(MEMORY_LABELS[key], memory.get(key, 0.0)) for key in MEMORY_TERMS], GIB, gib)
    _legend_beside(ax)
    ax.set_xlim(0, max(capacity, estimate["peak_memory_bytes"]) / GIB * 1.08)
    where = f" (pipeline rank {estimate['worst_pp_rank']})" if estimate["layout"].get("pp", 1) > 1 else ""
    ax.set_xlabel(f"GiB on the most-loaded GPU{where}")
    ax.set_title(f"memory {fit_text(estimate)}", color=FIT_COLOURS[bool(estimate["fits"])], fontweight="bold")


def _seconds(value_s: float) -> str:
    if value_s >= 1:
        return f"{value_s:,.2f} s"
    return f"{value_s * 1e3:,.1f} ms" if value_s >= 1e-3 else f"{value_s * 1e6:,.0f} us"


def plot_report(report: dict, path: Path) -> None:
    """`report_figure`, saved to `path`."""
    _save(report_figure(report), path)


def report_figure(report: dict):
    """One bar per term: predicted / measured (1 = exact), the +-15% band marked, each bar coloured
    by its prediction error as the report's table colours it, with the legend of the colours."""
    plt = _pyplot()
    from matplotlib.patches import Patch  # lazy: see _pyplot

    rows = [r for r in report["rows"] if r["predicted"] and r["measured"] is not None]
    if not rows:
        raise Plan3dError("nothing to plot: no term has both a prediction and a measurement")
    fig, ax = plt.subplots(figsize=(7, 0.5 * len(rows) + 2.0))
    names = [r["term"] for r in rows]
    ratios = [r["predicted"] / r["measured"] for r in rows]
    ax.barh(names, ratios, color=[error_colour(x - 1, plot=True) for x in ratios])
    ax.axvline(1.0, color="black", linewidth=1)
    for lim in (0.85, 1.15):
        ax.axvline(lim, color="gray", linestyle=":", linewidth=1)
    ax.set(xlabel="predicted / measured (1 = exact; dotted: +-15%)", title=f"run {report['layout']}")
    ax.invert_yaxis()
    handles = [Patch(color=colour, label=what) for colour, what in error_legend(plot=True)]
    fig.legend(handles=handles, title="prediction error (predicted / measured - 1)", fontsize=7, title_fontsize=7,
               loc="lower center", ncol=len(handles), frameon=False)
    fig.tight_layout(rect=(0, 0.1, 1, 1))  # room for the legend under the axes
    return fig
