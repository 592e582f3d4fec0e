"""Tables and JSON for `plan3d recommend` and `plan3d explain`. SI inside, human units here."""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from plan3d import grouping, ranking
from plan3d.cost.trust import provenance
from plan3d.layout import short_order
from plan3d.ranking import pareto_front
from plan3d.render.engine import engine_line, provenance_lines
from plan3d.render.units import GIB, gib, ms, printable
from plan3d.search import SearchResult
from plan3d.specs.schedule import default_codes
from plan3d.vocab import UTILISATION, seconds_column

SCHEMA_VERSION = 1
METRICS = (("step_time_s", "tokens_per_s", "model_tflops_per_gpu", *UTILISATION, "bubble_fraction", "peak_memory_bytes",
            "capacity_bytes") + tuple(seconds_column(t) for t in ranking.EXPLAINED_TERMS))
SECONDS_PER_DAY = 86400.0
MFU_NOTE = ("MFU: model FLOPs with causal attention (half the s^2 term); --json also gives mfu_noncausal (the full "
            "s^2 term) and hfu (hardware FLOPs with the recompute pass)")


@dataclass
class Recommendation:
    result: SearchResult
    order: np.ndarray
    objective: str
    top: int
    pick: int = 1
    sweep: list[SearchResult] | None = None
    tokens: float | None = None
    notes: list[str] = field(default_factory=list)
    nodes_needed: int | None = None
    ranking: str = "expected"  # how error bands count (plan3d.ranking.RANKINGS)

    @cached_property
    def decisions(self) -> list[grouping.Decision]:
        """The ranked distinct decisions (`plan3d.grouping`), one past what is shown or picked."""
        feasible = self.order[self.result.feasible[self.order]]
        if not len(feasible):
            return []
        values = grouping.objective_values(self.result.metrics, self.objective)
        return grouping.group_decisions(self.result.layouts, values, feasible, max(self.top, self.pick))

    @property
    def shown(self) -> np.ndarray:
        return np.array([d.head for d in self.decisions[: self.top]], dtype=np.int64)

    @property
    def ranked_decisions(self) -> np.ndarray:
        """The decisions' heads in rank order (the full order when fewer than two), so that "why #1"
        compares #1 with row #2 of the table rather than with a near-copy folded into #1."""
        heads = [d.head for d in self.decisions]
        return np.array(heads, dtype=np.int64) if len(heads) >= 2 else self.order

    @property
    def picked_row(self) -> int:
        """The row of decision #pick (what --out writes and --explain explains)."""
        return self.decisions[self.pick - 1].head

    @cached_property
    def warnings(self) -> dict[int, list[str]]:
        """What `plan3d estimate` warns of for each shown layout (row -> warnings, `ranking.layout_warnings`)."""
        return {int(row): ranking.layout_warnings(self.result, int(row)) for row in self.shown}

    @property
    def next_decision(self) -> grouping.Decision | None:
        """The best decision not shown: what the user would look at next."""
        return self.decisions[self.top] if len(self.decisions) > self.top else None


# ---- plain data (JSON) ---------------------------------------------------------------------------
def row_dict(result: SearchResult, row: int, tokens: float | None = None) -> dict:
    m = result.metrics
    lay = result.layout(row)
    unit = {knob for knob in ("cp", "ep") if getattr(lay, knob) == 1}  # left out at 1, as before cp and ep existed
    out = {"layout": lay.model_dump(mode="json", exclude=unit, exclude_none=True)}
    out.update({k: float(m[k][row]) for k in METRICS if k in m})
    out["headroom_bytes"] = out["capacity_bytes"] - out["peak_memory_bytes"]
    out["fits"] = bool(m["fits"][row])
    out["dominant_comm"] = ranking.dominant_comm(m, row)
    if result.bands is not None:
        band = result.band(row)
        out["step_time_s_band"] = list(band.step_band(out["step_time_s"]))
        out["validated"] = band.validated
        out["region"] = band.summary()
    if tokens:
        out["days_to_train"] = tokens / out["tokens_per_s"] / SECONDS_PER_DAY
    return out


def recommendation_dict(report: Recommendation, explain: bool = False) -> dict:
    r = report.result
    payload = {
        "schema_version": SCHEMA_VERSION, "engine": engine_name(r), "cluster": r.cluster.name,
        "nodes": r.cluster.nodes, "gpus": r.cluster.world_size, "model": r.model.name,
        "training": r.training.model_dump(mode="json"), "objective": report.objective, "search": r.stats(),
        "top": [dict(rank=i + 1, **row_dict(r, d.head, report.tokens), alternatives=alternatives_list(r, d),
                     warnings=report.warnings[d.head]) for i, d in enumerate(report.decisions[: report.top])],
        "why": ranking.why_wins(r, report.ranked_decisions, report.objective),
        "ranking": report.ranking,
        "passed_over": [row_dict(r, row) for row in passed_over_heads(report)],
        "best_validated": (row_dict(r, best) if (best := best_validated(report)) is not None else None),
        "pareto_front": [row_dict(r, int(row)) for row in ranking.pareto_front(r, report.order)],
    }
    if not r.feasible_count:
        payload["nearest_misses"] = [miss_dict(r, int(row)) for row in ranking.nearest_misses(r, report.order)]
        payload["nodes_needed"] = report.nodes_needed
    if report.next_decision is not None:
        payload["next_alternative"] = row_dict(r, report.next_decision.head, report.tokens)
    if report.sweep is not None:
        payload["node_sweep"] = [sweep_row(s, report.objective, report.ranking) for s in report.sweep]
    if explain and r.feasible_count:
        payload["explain"] = explanation_dict(Explanation(r, report.order, report.picked_row, report.objective))
    payload["warnings"] = trust_warnings(report)
    payload["notes"] = report.notes
    return payload


def passed_over_heads(report: Recommendation, limit: int = 3) -> list[int]:
    """Up to `limit` layouts predicted faster than #1 but ranked below it (extrapolated on more
    features, not faster beyond the bands), one per tp/pp/dp/mb/ZeRO decision."""
    r = report.result
    if not r.feasible_count:
        return []
    seen, out = set(), []
    for row in ranking.passed_over(r, report.order, report.objective):
        shape = tuple(int(r.layouts[k][row]) for k in grouping.DECISION_KNOBS if k in r.layouts)
        if shape not in seen:
            seen.add(shape)
            out.append(row)
        if len(out) == limit:
            break
    return out


def best_validated(report: Recommendation) -> int | None:
    """The best-ranked validated layout when #1 is not validated (None: #1 is, or none is)."""
    r = report.result
    if not r.feasible_count or r.bands is None or r.band(report.picked_row).validated:
        return None
    rows = report.order[r.feasible[report.order]]
    hits = rows[r.metrics["band_tier"][rows] == 0]
    return int(hits[0]) if len(hits) else None


def band_lines(report: Recommendation) -> list[str]:
    """What the bands say about the ranking: #1's extrapolations, the best validated layout, and
    the layouts predicted faster that the bands kept below #1."""
    r = report.result
    if not r.feasible_count or r.bands is None:
        return []
    first = report.decisions[0].head
    band = r.band(first)
    lines = [f"band: the measured step of 80% of published runs like it (left out of the fit) lies in it; ranking "
             f"{report.ranking}" + (": a layout extrapolated on more features ranks higher only when it wins beyond "
                                   "both bands" if report.ranking == "expected" else "")]
    fast, slow = band.band_pct()
    lines.append(f"#1's band, {fast:+.0f}%/{slow:+.0f}% of its step ({'validated' if band.validated else 'extrapolated'}): "
                 f"{band.makeup()}")
    if not band.validated:
        best = best_validated(report)
        if best is not None:
            gap = float(r.metrics["tokens_per_s"][best] / r.metrics["tokens_per_s"][first] - 1)
            lines.append(f"best validated layout: {r.layout(best).short()} ({_signed_pct(gap)} tokens/s against #1)")
        elif not (r.metrics["band_tier"][r.feasible] == 0).any():
            lines.append("no layout of this search is validated: every one is extrapolated on "
                         f"{', '.join(band.relaxed)}")
    lo, hi = band.step_band(float(r.metrics["step_time_s"][first]))
    for row in passed_over_heads(report):
        other = r.band(row)
        gain = float(r.metrics["tokens_per_s"][row] / r.metrics["tokens_per_s"][first] - 1)
        olo, ohi = other.step_band(float(r.metrics["step_time_s"][row]))
        more = [s for a, s in zip(other.relaxed, other.extrapolated) if a not in band.relaxed]
        lines.append(f"possibly faster, extrapolated: {r.layout(row).short()} ({_signed_pct(gain)} tokens/s predicted; "
                     f"{'; '.join(more)}): its step may be {duration(olo)}-{duration(ohi)}, #1's "
                     f"{duration(lo)}-{duration(hi)}: not faster beyond the bands")
    return lines


def trust_warnings(report: Recommendation) -> list[str]:
    """What `plan3d estimate` warns of for the #1 layout (a group over a slower tier, a GPU or ZeRO
    stage no calibration run had, ...); with nothing that fits, what is outside the validated
    region (`plan3d.cost.trust`), so a ranking on guessed values says so."""
    r = report.result
    if report.decisions:
        return report.warnings[report.decisions[0].head]
    return provenance(r.cluster, r.engine, r.training, 0).warnings


def warning_lines(report: Recommendation) -> list[str]:
    """Each shown layout's estimate warnings, once per text with the rows it holds for:
    'warning (#1-#3): CP group spans 8 nodes ...'."""
    ranks: dict[str, list[int]] = {}
    for rank, d in enumerate(report.decisions[: report.top], 1):
        for warning in report.warnings[d.head]:
            ranks.setdefault(warning, []).append(rank)
    return [f"[yellow]warning[/yellow] ({_ranks_text(rows)}): {escape(text)}" for text, rows in ranks.items()]


def _ranks_text(ranks: list[int]) -> str:
    """'#1', '#1-#3', '#1, #3'."""
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"#{ranks[0]}-#{ranks[-1]}"
    return ", ".join(f"#{k}" for k in ranks)


def alternatives_list(result: SearchResult, decision: grouping.Decision) -> list[dict]:
    """The near-ties a row stands for: what each changes, and its figures."""
    head = result.layout(decision.head)
    return [{"differs": grouping.difference(head, result.layout(row)), **row_dict(result, row)}
            for row in decision.alternatives]


def engine_name(result: SearchResult) -> str:
    """The engine the search predicted for ("" : the cluster's values alone)."""
    return result.engine.name if result.engine is not None else ""


def miss_dict(result: SearchResult, row: int) -> dict:
    out = row_dict(result, row)
    out["over_bytes"] = out["peak_memory_bytes"] - out["capacity_bytes"]
    out["what_to_change"] = [{"change": s.change, "peak_memory_bytes": s.peak_memory_bytes, "fits": s.fits}
                             for s in ranking.suggestions(result, row)]
    return out


def sweep_row(result: SearchResult, objective: str, mode: str = "expected") -> dict:
    order = ranking.rank(result, objective, mode)
    best = int(order[0]) if len(order) and result.feasible[order[0]] else None
    row = {"nodes": result.cluster.nodes, "gpus": result.cluster.world_size, "feasible": result.feasible_count}
    if best is not None:
        row.update(best=row_dict(result, best))
    return row


def no_fit_message(report: Recommendation) -> str:
    r = report.result
    if not r.size:
        reasons = "; ".join(f"{n} x {why}" for why, n in r.rejected_by_reason().items())
        reasons = f" ({reasons})" if reasons else ""  # fixed knobs can leave no candidate to reject
        return (f"no valid layout of {r.model.name} on {r.cluster.world_size} GPUs{reasons}: tp must divide the "
                f"heads and KV heads ({r.model.heads}/{r.model.kv_heads_}), pp*vpp the {r.model.layers} layers and dp the "
                f"global batch ({r.training.global_batch}); try other --nodes, a larger --global-batch, or wider bounds")
    more = (f"the smallest cluster that fits has {report.nodes_needed} nodes (--nodes {report.nodes_needed})"
            if report.nodes_needed else "no larger cluster tried (up to 64x, 131,072 GPUs) fits either")
    return (f"no layout of {r.model.name} fits on {r.cluster.nodes} x {r.cluster.gpus_per_node} {r.cluster.gpu.name}: "
            f"{r.size} valid layouts all exceed memory or a threshold; {more}; see the nearest misses above")


# ---- rich tables ---------------------------------------------------------------------------------
def wide_console() -> Console:
    """A terminal's own width; 160 columns when piped (CI logs), so the table is not squeezed."""

    return Console() if sys.stdout.isatty() else Console(width=160)


def duration(seconds: float) -> str:
    return ms(seconds) if abs(seconds) < 10 else f"{seconds:.1f} s" if abs(seconds) < 1e6 else f"{seconds:.3g} s"


def _pct(x: float) -> str:
    return f"{x * 100:.1f}%"


def layout_cells(result: SearchResult, row: int) -> list[str]:
    lay = result.layout(row)
    order = short_order(lay.order)
    pp = f"{lay.pp}*" if lay.pp_layers is not None else str(lay.pp)
    cp = [str(lay.cp)] if shows_cp(result) else []
    ep = [str(lay.ep)] if shows_ep(result) else []
    etp = [str(lay.expert_tp)] if shows_etp(result) else []
    schedule = [SCHEDULE_LABELS.get(lay.pipeline_schedule, lay.pipeline_schedule) if lay.pp > 1 else ""
                ] if shows_schedule(result) else []
    return [str(lay.tp), pp, str(lay.dp), *cp, *ep, *etp, str(lay.micro_batch), str(lay.vpp), *schedule, str(lay.zero),
            recompute_cell(lay.recompute, result.metrics.get("recompute_layers"), row),
            "y" if lay.sequence_parallel else "", order]


def recompute_cell(recompute: str, layers, row: int) -> str:
    """'partial 3' (the first 3 layers of each virtual chunk recomputed), else the mode."""
    if recompute != "partial" or layers is None:
        return recompute
    return f"partial {int(layers[row])}"


def shows_cp(result: SearchResult) -> bool:
    """Whether the table has a cp column: only when the search evaluated some cp > 1."""
    cp = result.layouts.get("cp")
    return cp is not None and bool((cp > 1).any())


def shows_ep(result: SearchResult) -> bool:
    """Whether the table has an ep column: only when the search evaluated some ep > 1."""
    ep = result.layouts.get("ep")
    return ep is not None and bool((ep > 1).any())


SCHEDULE_LABELS = {"interleaved-1f1b": "i-1f1b"}  # the table's short names (--json: the full one)


def shows_schedule(result: SearchResult) -> bool:
    """Whether the table has a schedule column: only when the search evaluated a schedule other
    than the one vpp alone selects (1F1B, interleaved 1F1B)."""
    codes = result.layouts.get("schedule")
    return codes is not None and bool((codes != default_codes(result.layouts["vpp"])).any())


def shows_etp(result: SearchResult) -> bool:
    """Whether the table has an etp column: only when the search evaluated experts split over
    another tensor-parallel degree than tp (MoE Parallel Folding)."""
    etp = result.layouts.get("etp")
    return etp is not None and bool((etp != result.layouts["tp"]).any())


def metric_cells(result: SearchResult, row: int, tokens: float | None) -> list[str]:
    d = row_dict(result, row, tokens)
    cells = [f"{d['peak_memory_bytes'] / GIB:.1f}", f"{d['headroom_bytes'] / GIB:.1f}", duration(d["step_time_s"]),
             *band_cells(result, row), f"{d['tokens_per_s']:,.0f}", _pct(d["mfu"]),
             _pct(d["bubble_fraction"]), d["dominant_comm"]]
    if tokens:
        cells.append(f"{d['days_to_train']:.1f}")
    return cells


HEADERS = ["#", "tp", "pp", "dp", "mb", "vpp", "zero", "recompute", "sp", "order", "mem GiB", "free GiB",
           "step", "band", "validated", "tokens/s", "MFU", "bubble", "top comm"]
# the short names of a band's extrapolated features in the table (plan3d.cost.bands.AXES)
AXIS_LABELS = {"engine": "engine", "gpu": "gpu", "sharding": "ZeRO-3", "cp": "cp", "moe": "MoE", "fp8": "fp8",
               "zero_bubble": "zero-bubble", "offload": "offload", "scale": "scale"}


def band_cells(result: SearchResult, row: int) -> list[str]:
    """'-7/+23%' (the measured step against the prediction) and 'yes' or 'no: gpu, ZeRO-3'."""
    if result.bands is None:
        return ["", ""]
    band = result.band(row)
    fast, slow = band.band_pct()
    return [f"{fast:+.0f}/{slow:+.0f}%",
            "yes" if band.validated else "no: " + ", ".join(AXIS_LABELS[a] for a in band.relaxed)]
ALSO_SHOWN = 3  # alternatives named per row under the table; --json lists all


def layouts_table(result: SearchResult, rows, title: str, tokens: float | None = None) -> Table:
    table = Table(title=title)
    headers = (HEADERS[:4] + (["cp"] if shows_cp(result) else []) + (["ep"] if shows_ep(result) else [])
               + (["etp"] if shows_etp(result) else []) + HEADERS[4:6] + (["schedule"] if shows_schedule(result) else [])
               + HEADERS[6:])
    for header in headers + (["days"] if tokens else []):
        table.add_column(header, justify="left" if header in ("recompute", "order", "top comm", "validated", "schedule")
                         else "right")
    for i, row in enumerate(rows):
        table.add_row(str(i + 1), *layout_cells(result, int(row)), *metric_cells(result, int(row), tokens))
    return table


def alternatives_text(result: SearchResult, decision: grouping.Decision) -> str:
    """'vpp8 -0.2%; selective recompute -0.4%; +3 more' (change against the row, tokens/s difference)."""
    metric = result.metrics["tokens_per_s"]
    head = result.layout(decision.head)
    named = [f"{grouping.difference(head, result.layout(row))} {_signed_pct(metric[row] / metric[decision.head] - 1)}"
             for row in decision.alternatives[:ALSO_SHOWN]]
    more = len(decision.alternatives) - ALSO_SHOWN
    return "; ".join(named + ([f"+{more} more"] if more > 0 else []))


def _signed_pct(x: float) -> str:
    return f"{x * 100:+.1f}%"


def alternatives_lines(report: Recommendation) -> list[str]:
    """'#1 also: selective recompute -1.2%' for each shown row that stands for near-ties."""
    return [f"#{i + 1} also: {alternatives_text(report.result, d)}"
            for i, d in enumerate(report.decisions[: report.top]) if d.alternatives]


def decisions_line(report: Recommendation) -> str:
    """How rows were folded, and the next different choice after the shown ones."""
    r = report.result
    knobs = "tp/pp/dp" + ("/cp" if shows_cp(r) else "") + ("/ep" if shows_ep(r) else "") + "/mb/ZeRO"
    line = (f"one row per decision: layouts of one {knobs} within {grouping.TIE_FRACTION:.0%} "
            "of each other are one row, their alternatives named below (--json: `alternatives`)")
    nxt = report.next_decision
    if nxt is not None:
        best = float(r.metrics["tokens_per_s"][report.decisions[0].head])
        change = float(r.metrics["tokens_per_s"][nxt.head]) / best - 1
        line += f"; next: #{report.top + 1} {r.layout(nxt.head).short()} ({_signed_pct(change)} tokens/s against #1)"
    return line


def print_engine(result: SearchResult, console: Console) -> None:

    if result.engine is not None:
        console.print(engine_line(result.engine))


def print_recommendation(report: Recommendation, explain: bool = False, console: Console | None = None) -> None:
    console = console or wide_console()
    r = report.result
    print_engine(r, console)
    if report.sweep is not None:
        console.print(sweep_table(report))
        fewest = next((s.cluster.nodes for s in report.sweep if s.feasible_count), None)
        console.print(f"fewest nodes with a layout that fits: {fewest} (its layouts below)" if fewest
                      else "no node count of the sweep fits (the largest is shown below)")
    title = printable(f"{r.model.name} on {r.cluster.nodes} x {r.cluster.gpus_per_node} {r.cluster.gpu.name} "
                      f"({r.cluster.world_size} GPUs), global batch {r.training.global_batch}, "
                      f"objective {report.objective}")
    if r.feasible_count:
        console.print(layouts_table(r, report.shown, title, report.tokens))
        console.print(decisions_line(report))
        for line in alternatives_lines(report):
            console.print(line)
        if any(r.layout(int(row)).pp_layers is not None for row in report.shown):
            console.print("* uneven split: the first and last stages hold fewer layers (--json lists pp_layers)")
        console.print(f"[bold]why #1:[/bold] {ranking.why_wins(r, report.ranked_decisions, report.objective)}")
        for line in band_lines(report):
            console.print(escape(line))
        console.print(MFU_NOTE)
        for line in warning_lines(report):
            console.print(line)
        front = ranking.pareto_front(r, report.order)
        console.print(f"Pareto front (tokens/s vs memory headroom): {len(front)} layouts; "
                      f"most headroom {gib(_headroom(r, int(front[-1])))} at {r.layout(int(front[-1])).short()}")
    else:
        console.print(f"[bold red]nothing fits:[/bold red] {title}")
        print_misses(report, console)
    console.print(stats_line(r))
    for why, n in r.rejected_by_reason().items():
        console.print(f"  rejected {n:>10,}  {why}")
    if explain and r.feasible_count:
        print_explanation(Explanation(r, report.order, report.picked_row, report.objective), console, engine=False)
    for note in report.notes:
        console.print(note)


def _headroom(result: SearchResult, row: int) -> float:
    return float(result.metrics["capacity_bytes"][row] - result.metrics["peak_memory_bytes"][row])


def stats_line(result: SearchResult) -> str:
    s = result.stats()
    return (f"searched {s['layouts_considered']:,} layouts in {s['seconds'] * 1e3:.0f} ms "
            f"({s['layouts_per_s'] or 0:,} layouts/s): {s['layouts_evaluated']:,} valid, {s['feasible']:,} fit")


def print_misses(report: Recommendation, console: Console) -> None:
    r = report.result
    misses = ranking.nearest_misses(r, report.order)
    if len(misses):
        console.print(layouts_table(r, misses, "nearest misses (closest to fitting first)"))
    for i, row in enumerate(misses[:3]):
        d = miss_dict(r, int(row))
        console.print(f"#{i + 1} {r.layout(int(row)).short()}: needs {gib(d['peak_memory_bytes'])} of "
                      f"{gib(d['capacity_bytes'])} usable ({gib(d['over_bytes'])} over)")
        for s in d["what_to_change"]:
            verdict = "fits" if s["fits"] else "still over"
            console.print(f"     {s['change']}: {gib(s['peak_memory_bytes'])} ({verdict})")
    if report.nodes_needed:
        console.print(f"more nodes: the smallest cluster (doubling) with a layout that fits has "
                      f"{report.nodes_needed} nodes: --nodes {report.nodes_needed}")


def sweep_table(report: Recommendation) -> Table:
    table = Table(title="how many nodes: best layout per node count")
    for header in ("nodes", "GPUs", "fit", "best layout", "tokens/s", "tokens/s/GPU", "MFU", "mem GiB"):
        table.add_column(header, justify="left" if header == "best layout" else "right")
    for result in report.sweep:
        row = sweep_row(result, report.objective, report.ranking)
        best = row.get("best")
        cells = ([result.layout(ranking.rank(result, report.objective, report.ranking)[0]).short(),
                  f"{best['tokens_per_s']:,.0f}",
                  f"{best['tokens_per_s'] / row['gpus']:,.0f}", _pct(best["mfu"]),
                  f"{best['peak_memory_bytes'] / GIB:.1f}"] if best else ["none fits", "", "", "", ""])
        table.add_row(str(row["nodes"]), str(row["gpus"]), f"{row['feasible']:,}", *cells)
    return table


# ---- explain -----------------------------------------------------------------------------------
@dataclass
class Explanation:
    result: SearchResult
    order: np.ndarray
    row: int
    objective: str

    @property
    def position(self) -> int:
        return int(np.flatnonzero(self.order == self.row)[0]) + 1

    @property
    def best(self) -> int:
        return int(self.order[0])


# the labels of the explain table's time rows, one per term `ranking.EXPLAINED_TERMS` compares
EXPLAIN_TIME_LABELS = {"compute": "compute", "recompute": "recompute", "bubble": "bubble", "tp_comm": "TP comm",
                       "pp_comm": "PP comm", "ep_comm": "EP all-to-all",
                       "offload": "offload", "dp_comm": "DP comm", "zero_comm": "ZeRO comm", "optimizer": "optimizer"}
EXPLAIN_ROWS = ((("tokens/s", "tokens_per_s"), ("step time", "step_time_s"))
                + tuple((EXPLAIN_TIME_LABELS[t], seconds_column(t)) for t in ranking.EXPLAINED_TERMS)
                + (("peak memory", "peak_memory_bytes"), ("MFU", "mfu")))


def explanation_sentences(ex: Explanation) -> list[str]:
    r, row, best = ex.result, ex.row, ex.best
    feasible = r.feasible_count
    where = (f"ranks #{ex.position} of {feasible} feasible layouts" if r.feasible[row]
             else f"does not fit ({gib(float(r.metrics['peak_memory_bytes'][row]))} needed, "
                  f"{gib(float(r.metrics['capacity_bytes'][row]))} usable): ranked after all {feasible} that fit")
    lines = [f"{r.layout(row).short()} ({r.layout(row).order}) {where}, out of {r.considered:,} layouts considered"]
    if row == best:
        lines.append("it is the best: " + ranking.why_wins(r, ex.order, ex.objective))
    elif r.feasible[best]:
        lines.append("the best " + ranking.compare_sentence(r, best, row, "this layout"))
    if r.bands is not None:
        same = row != best and r.band(best) == r.band(row)
        lines += [band_sentence(r, row, "this layout")] + ([band_sentence(r, best, "the best", same)] if row != best else [])
    return lines


def band_sentence(result: SearchResult, row: int, name: str, same_band: bool = False) -> str:
    """'this layout: step 37.7 s-62.2 s for 44.2 s predicted (-15%/+41%), the band of megatron-core on
    ampere, ... (extrapolated): prediction error -29%/+17%: 14 left-out runs of ... (Band.makeup)'."""
    band = result.band(row)
    step = float(result.metrics["step_time_s"][row])
    lo, hi = band.step_band(step)
    fast, slow = band.band_pct()
    head = f"{name}: step {duration(lo)}-{duration(hi)} for {duration(step)} predicted ({fast:+.0f}%/{slow:+.0f}%)"
    if same_band:
        return f"{head}, the same band"
    return (f"{head}, the band of {band.region.name} ({'validated' if band.validated else 'extrapolated'}): "
            f"{band.makeup()}")


def explanation_dict(ex: Explanation) -> dict:
    trust = explanation_trust(ex)
    return {"schema_version": SCHEMA_VERSION, "engine": engine_name(ex.result), "position": ex.position,
            "feasible": ex.result.feasible_count, "considered": ex.result.considered,
            "layout": row_dict(ex.result, ex.row), "best": row_dict(ex.result, ex.best),
            "sentences": explanation_sentences(ex), "provenance": trust.lines,
            "warnings": ranking.layout_warnings(ex.result, ex.row)}


def explanation_trust(ex: Explanation):
    """Which fitted values the explained numbers used, from what data (`plan3d.cost.trust`)."""

    r = ex.result
    return provenance(r.cluster, r.engine, r.training, r.layout(ex.row).zero)


def _fmt(key: str, value: float) -> str:
    if key == "tokens_per_s":
        return f"{value:,.0f}"
    if key.endswith("_s"):
        return duration(value)
    if key.endswith("_bytes"):
        return gib(value)
    return _pct(value) if key == "mfu" else f"{value:,.0f}"


def print_explanation(ex: Explanation, console: Console | None = None, engine: bool = True) -> None:
    """The term table and sentences; `engine`: also the engine line (off under `recommend`, which printed it)."""


    console = console or wide_console()
    r, m = ex.result, ex.result.metrics
    if engine:
        print_engine(r, console)
    table = Table(title=f"explain: {r.layout(ex.row).short()} against the best, {r.layout(ex.best).short()}")
    for header in ("term", "this layout", "best", "difference"):
        table.add_column(header, justify="left" if header == "term" else "right")
    moe_only = () if r.model.moe is not None else (seconds_column("ep_comm"),)  # no all-to-all row for dense models
    for label, key in (row for row in EXPLAIN_ROWS if row[1] in m and row[1] not in moe_only):
        this, best = float(m[key][ex.row]), float(m[key][ex.best])
        diff = _fmt(key, this - best) if key != "mfu" else f"{(this - best) * 100:+.1f} pts"
        table.add_row(label, _fmt(key, this), _fmt(key, best), diff)
    console.print(table)
    for line in explanation_sentences(ex):
        console.print(line)
    for line in provenance_lines(explanation_trust(ex).lines):
        console.print(line)
    for warning in ranking.layout_warnings(r, ex.row):  # what `plan3d estimate` says of it
        console.print(f"[yellow]warning:[/yellow] {escape(warning)}")


def pareto_points(result, order, picked: int | None = None, pick: int = 1) -> list[dict]:
    """Every feasible layout as a point for `plots.plot_pareto`: the Pareto front and the `picked`
    row labelled, the picked one with its rank `pick` in the table."""

    front = set(pareto_front(result, order).tolist())
    rows = order[result.feasible[order]].tolist()
    metrics = result.metrics
    points = [{"tokens_per_s": float(metrics["tokens_per_s"][r]),
               "peak_memory_bytes": float(metrics["peak_memory_bytes"][r]),
               "pareto": r in front, "label": result.layout(r).short() if r in front or r == picked else ""}
              for r in rows]
    if picked is not None:
        points[rows.index(picked)]["rank"] = pick
    return points


def picked_index(result, order, picked: int) -> int:
    """Where the picked row is among `pareto_points`."""
    return order[result.feasible[order]].tolist().index(picked)
