"""Pictures (matplotlib, imported lazily; `pip install plan3d[plot]`). Each writes one file.

    plot_pareto(points, path)             recommend --plot: throughput vs memory, Pareto front marked
    plot_step_breakdown(estimate, path)   estimate --plot: the step as a stacked bar of its terms
    plot_report(report, path)             report --plot: measured vs predicted per term

The file type follows the suffix (.png, .svg, .pdf). Inputs are plain dicts in SI units, so the
callers pass `Estimate.to_dict()` or `Report.to_dict()` and nothing here knows the cost model.
"""
from __future__ import annotations

from pathlib import Path

from plan3d.errors import Plan3dError

TIME_TERMS = (("compute", "compute"), ("recompute", "recompute"), ("bubble", "bubble"),
              ("tp_comm", "TP comm"), ("pp_comm", "PP comm"), ("dp_comm", "DP comm"),
              ("zero_comm", "ZeRO-3 gathers"), ("optimizer", "optimizer"))


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise Plan3dError("--plot needs matplotlib: pip install 'plan3d[plot]'") from None
    matplotlib.use("Agg")  # files only, never a window
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> None:
    path = Path(path)
    if path.suffix.lower() not in (".png", ".svg", ".pdf"):
        raise Plan3dError(f"--plot {path}: use a .png, .svg or .pdf file name")
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    import matplotlib.pyplot as plt

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


def plot_pareto(points: list[dict], path: Path, capacity_bytes: float | None = None) -> None:
    """Scatter of feasible layouts: x peak memory (GiB), y tokens/s; the Pareto front joined.

    Each point: {'tokens_per_s', 'peak_memory_bytes', optional 'label', optional 'pareto': bool}
    (without 'pareto' the front is computed here)."""
    if not points:
        raise Plan3dError("nothing to plot: no feasible layout")
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    marked = [i for i, p in enumerate(points) if p.get("pareto")] if any("pareto" in p for p in points) \
        else pareto_front(points)
    ax.scatter([p["peak_memory_bytes"] / 2**30 for p in points], [p["tokens_per_s"] for p in points],
               s=12, alpha=0.5, color="tab:gray", label="feasible layouts")
    front = sorted(marked, key=lambda i: points[i]["peak_memory_bytes"])
    ax.plot([points[i]["peak_memory_bytes"] / 2**30 for i in front], [points[i]["tokens_per_s"] for i in front],
            "o-", color="tab:red", label="Pareto front")
    for i in front[::max(1, len(front) // 6)]:  # a handful of labels, spread along the front
        if points[i].get("label"):
            ax.annotate(points[i]["label"], (points[i]["peak_memory_bytes"] / 2**30, points[i]["tokens_per_s"]),
                        fontsize=7, xytext=(4, 4), textcoords="offset points")
    if capacity_bytes:
        ax.axvline(capacity_bytes / 2**30, color="tab:blue", linestyle="--", label="usable memory")
    ax.set(xlabel="peak memory of the most-loaded GPU (GiB)", ylabel="tokens/s", title="throughput vs memory")
    ax.legend(fontsize=8)
    _save(fig, path)


def plot_step_breakdown(estimate: dict, path: Path) -> None:
    """One stacked bar of the step time: compute, recompute, bubble, communication, optimizer."""
    plt = _pyplot()
    time_s = estimate["time_s"]
    fig, ax = plt.subplots(figsize=(7, 3.0))
    left = 0.0
    for key, label in TIME_TERMS:
        value_s = time_s.get(key, 0.0)
        if value_s > 0:
            ax.barh([0], [value_s], left=left, label=f"{label} {_seconds(value_s)}")
            left += value_s
    ax.set(yticks=[], xlabel="seconds per step", title=f"predicted step {_seconds(estimate['step_time_s'])}")
    ax.legend(fontsize=7, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.45))
    _save(fig, path)


def _seconds(value_s: float) -> str:
    return f"{value_s:,.2f} s" if value_s >= 1 else f"{value_s * 1e3:,.1f} ms"


def plot_report(report: dict, path: Path) -> None:
    """One bar per term: predicted / measured (1 = exact), the +-15% band marked."""
    plt = _pyplot()
    rows = [r for r in report["rows"] if r["predicted"] and r["measured"] is not None]
    if not rows:
        raise Plan3dError("nothing to plot: no term has both a prediction and a measurement")
    fig, ax = plt.subplots(figsize=(7, 0.5 * len(rows) + 1.5))
    names = [r["term"] for r in rows]
    ratios = [r["predicted"] / r["measured"] for r in rows]
    ax.barh(names, ratios, color=["tab:green" if abs(x - 1) <= 0.15 else "tab:orange" for x in ratios])
    ax.axvline(1.0, color="black", linewidth=1)
    for lim in (0.85, 1.15):
        ax.axvline(lim, color="gray", linestyle=":", linewidth=1)
    ax.set(xlabel="predicted / measured (1 = exact; dotted: +-15%)", title=f"run {report['layout']}")
    ax.invert_yaxis()
    _save(fig, path)
