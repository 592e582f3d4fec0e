"""Ranking of searched layouts: feasible first, then the objective within its error bands, then simplicity.

Order of the keys (first decides):
1. feasible (fits in memory with headroom and meets the user's thresholds) before infeasible;
2. the objective: tokens/s (default), MFU, or least memory; values within 1 ppm of each other
   tie (two layouts the model cannot tell apart are not ranked by rounding noise). How its error
   band counts (`RANKINGS`, time objectives only; plan3d.cost.bands):
   - `expected` (default): the prediction, but a layout extrapolated on more features than
     another (its band's `tier`) ranks above it only when it wins beyond both bands: its slow
     end faster than the other's fast end (`banded_keys`). Otherwise it ranks just below, and
     `passed_over` names it as "possibly faster, extrapolated";
   - `optimistic`: each band's fast end; `conservative`: each band's slow end;
3. fewer extrapolated features (the band's tier);
4. less peak memory per GPU;
5. fewer moving parts (`moving_parts`): no ZeRO, no recompute, no interleaving, no sequence
   parallelism, the default rank order, no pipeline, no tensor parallelism;
6. the knob values themselves, so the order is total and does not depend on enumeration order.
Infeasible layouts follow, nearest to fitting first (peak memory over capacity).
"""
from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

from plan3d.cost.estimate import estimate, idle_gpus_warning
from plan3d.errors import LayoutError
from plan3d.fit_rules import FitFacts, Thresholds, broken_fit_rules
from plan3d.layout import Layout, job_problems, layout_problems
from plan3d.search import (
    DEFAULT_ORDERS,
    LAYOUT_KNOBS,
    SearchResult,
    nodes_to_fit,
    search,
)
from plan3d.specs.schedule import default_codes
from plan3d.vocab import COMM_TERMS, TIME_TERMS, UTILISATION, seconds_column

OBJECTIVES = ("throughput", "mfu", "memory")
RANKINGS = ("expected", "optimistic", "conservative")
# The time terms `recommend` shows per layout (its JSON rows, --explain's table) and `why_wins`
# compares: every one but the host overhead.
EXPLAINED_TERMS = tuple(t for t in TIME_TERMS if t != "overhead")
TIE_PPM = 1e-6


def objective_cost(metrics: dict[str, np.ndarray], objective: str) -> np.ndarray:
    """Lower is better, quantised so values within TIE_PPM of the best tie."""
    if objective not in OBJECTIVES:

        raise LayoutError(f"--objective {objective!r}: use one of {', '.join(OBJECTIVES)}")
    if objective == "memory":
        value = np.asarray(metrics["peak_memory_bytes"], dtype=float)
        scale = value.min() if len(value) else 1.0
        return np.round(value / (scale * TIE_PPM))
    value = np.asarray(metrics["tokens_per_s" if objective == "throughput" else "mfu"], dtype=float)
    scale = value.max() if len(value) and value.max() > 0 else 1.0
    return -np.round(value / (scale * TIE_PPM))


def moving_parts(layouts: dict[str, np.ndarray]) -> np.ndarray:
    """How many optional mechanisms a layout switches on (fewer is simpler to run and debug)."""
    return ((layouts["zero"] > 0).astype(int) + layouts["zero"] // 3 + (layouts["recompute"] > 0)
            + (layouts["vpp"] > 1) + layouts["sequence_parallel"].astype(int) + (layouts["order"] > 0)
            + ((layouts["schedule"] != default_codes(layouts["vpp"])) if "schedule" in layouts else 0)  # not vpp's default
            + (layouts["pp"] > 1) + (layouts["tp"] > 1) + layouts["uneven"].astype(int)
            + ((layouts["cp"] > 1) if "cp" in layouts else 0) + ((layouts["ep"] > 1) if "ep" in layouts else 0))


def memory_fraction(result: SearchResult) -> np.ndarray:
    """Peak memory over the capacity a layout may use (> 1: does not fit)."""
    return result.metrics["peak_memory_bytes"] / result.metrics["capacity_bytes"]


def rank(result: SearchResult, objective: str = "throughput", ranking: str = "expected") -> np.ndarray:
    """Row indices of every evaluated layout, best first (see the module docstring)."""
    if not result.size:
        return np.zeros(0, dtype=np.int64)
    feasible = result.feasible
    cost = ranking_cost(result, objective, ranking)
    miss = np.where(feasible, 0.0, memory_fraction(result))
    tier = np.where(feasible, result.metrics.get("band_tier", np.zeros(result.size)), 0)
    tie_breaks = [result.layouts[k] for k in reversed(LAYOUT_KNOBS)]
    keys = tie_breaks + [moving_parts(result.layouts), result.metrics["peak_memory_bytes"], tier,
                         np.where(feasible, cost, 0), miss, ~feasible]
    return np.lexsort(keys)


def ranking_cost(result: SearchResult, objective: str, ranking: str) -> np.ndarray:
    """The objective as ranked (lower is better, quantised as `objective_cost`): for time
    objectives, read through each layout's error band as `ranking` says (module docstring)."""
    if ranking not in RANKINGS:
        raise LayoutError(f"--ranking {ranking!r}: use one of {', '.join(RANKINGS)}")
    if objective not in OBJECTIVES:
        raise LayoutError(f"--objective {objective!r}: use one of {', '.join(OBJECTIVES)}")
    m = result.metrics
    if objective == "memory" or "step_band_low_s" not in m:
        return objective_cost(m, objective)
    cost = 1.0 / np.asarray(objective_cost_values(m, objective), dtype=float)  # proportional to the step time
    fast, slow = cost * m["step_band_low_s"] / m["step_time_s"], cost * m["step_band_high_s"] / m["step_time_s"]
    if ranking == "optimistic":
        key = fast
    elif ranking == "conservative":
        key = slow
    else:
        key = banded_keys(cost, fast, slow, m["band_tier"], result.feasible)
    scale = key[result.feasible].min() if result.feasible.any() else 1.0
    return np.round(key / (scale * TIE_PPM))


def objective_cost_values(metrics: dict[str, np.ndarray], objective: str) -> np.ndarray:
    """The time objective's 'higher is better' value: tokens/s, or MFU."""
    return metrics["tokens_per_s" if objective == "throughput" else "mfu"]


def banded_keys(cost: np.ndarray, fast: np.ndarray, slow: np.ndarray, tier: np.ndarray,
                rows: np.ndarray) -> np.ndarray:
    """Ranking keys (lower first) under the band rule, for the `rows` mask: a layout of tier t
    keeps its own cost only against layouts of lower tiers it beats beyond the bands (its `slow`
    end below their `fast` end); the others it does not beat must rank above it, so its key is
    raised to the largest of their keys (ties then go to the lower tier: `rank`'s next key).
    Tier by tier from the lowest, so a lower tier's keys are final before a higher tier reads them."""
    key = np.array(cost, dtype=float)
    tiers = np.unique(tier[rows])
    for t in tiers[1:]:
        lower, upper = rows & (tier < t), np.flatnonzero(rows & (tier == t))
        by_fast = np.argsort(fast[lower], kind="stable")
        fast_sorted, prefix_max = fast[lower][by_fast], np.maximum.accumulate(key[lower][by_fast])
        beaten_by = np.searchsorted(fast_sorted, slow[upper], side="right")  # lower rows with fast <= slow
        blocked = np.where(beaten_by > 0, prefix_max[np.maximum(beaten_by - 1, 0)], -np.inf)
        key[upper] = np.maximum(key[upper], blocked)
    return key


def passed_over(result: SearchResult, order: np.ndarray, objective: str = "throughput") -> list[int]:
    """Feasible rows ranked below #1 whose prediction beats #1's: extrapolated on more features,
    they do not win beyond the bands (the `expected` ranking), best prediction first."""
    rows = order[result.feasible[order]]
    if not len(rows) or objective == "memory":
        return []
    values = objective_cost_values(result.metrics, objective)
    better = rows[1:][values[rows[1:]] > values[rows[0]] * (1 + TIE_PPM)]
    return [int(r) for r in better[np.argsort(-values[better], kind="stable")]]


def pareto_front(result: SearchResult, order: np.ndarray) -> np.ndarray:
    """Feasible rows not beaten on both tokens/s and memory headroom, by descending tokens/s."""
    rows = order[result.feasible[order]]
    if not len(rows):  # nothing feasible (or nothing valid: no metrics at all)
        return np.array([], dtype=np.int64)
    tokens = result.metrics["tokens_per_s"][rows]
    headroom = (result.metrics["capacity_bytes"] - result.metrics["peak_memory_bytes"])[rows]
    by_tokens = rows[np.lexsort((-headroom, -tokens))]
    front, best_headroom = [], -np.inf
    headroom_of = dict(zip(rows.tolist(), headroom.tolist()))
    for row in by_tokens.tolist():
        if headroom_of[row] > best_headroom:
            front.append(row)
            best_headroom = headroom_of[row]
    return np.array(front, dtype=np.int64)


def nearest_misses(result: SearchResult, order: np.ndarray, k: int = 5) -> np.ndarray:
    """The k infeasible rows closest to fitting (ranking already puts them in that order)."""
    return order[~result.feasible[order]][:k]


def dominant_comm(metrics: dict[str, np.ndarray], row: int) -> str:
    """Name of the largest exposed communication term of a row ('-' when all are zero)."""
    terms = [t for t in COMM_TERMS if seconds_column(t) in metrics]
    values = [float(metrics[seconds_column(t)][row]) for t in terms]
    best = int(np.argmax(values))
    return terms[best].removesuffix("_comm") if values[best] > 0 else "-"


@dataclass(frozen=True)
class TermDelta:
    term: str  # a plan3d.vocab time term
    this_s: float
    other_s: float

    @property
    def saved_s(self) -> float:
        return self.other_s - self.this_s


def term_deltas(metrics: dict[str, np.ndarray], this: int, other: int) -> list[TermDelta]:
    """Per time term, this row's seconds against the other's, largest saving first."""
    columns = [(t, metrics[seconds_column(t)]) for t in EXPLAINED_TERMS if seconds_column(t) in metrics]
    deltas = [TermDelta(t, float(values[this]), float(values[other])) for t, values in columns]
    return sorted(deltas, key=lambda d: -abs(d.saved_s))


def why_wins(result: SearchResult, order: np.ndarray, objective: str = "throughput") -> str:
    """One sentence: why the first row beats the runner-up."""
    if not len(order) or not result.feasible[order[0]]:
        return "no layout fits"
    best = int(order[0])
    feasible = order[result.feasible[order]]
    if len(feasible) < 2:
        return f"{result.layout(best).short()} is the only layout that fits"
    runner = int(feasible[1])
    sentence = compare_sentence(result, best, runner, "the runner-up")
    other = other_degrees(result, feasible)
    if other is not None and other != runner:
        sentence += ". Against the best other tp/pp/dp: " + compare_sentence(result, best, other, "it")
    return sentence


def other_degrees(result: SearchResult, rows: np.ndarray) -> int | None:
    """The first of `rows` whose (tp, pp, dp, cp, ep) differ from the first row's."""
    lay = result.layouts
    first = rows[0]
    differ = np.zeros(len(rows), dtype=bool)
    for knob in ("tp", "pp", "dp", "cp", "ep"):
        if knob in lay:
            differ |= lay[knob][rows] != lay[knob][first]
    hits = np.flatnonzero(differ)
    return int(rows[hits[0]]) if len(hits) else None


def compare_sentence(result: SearchResult, best: int, other: int, other_name: str) -> str:
    """How `best` differs from `other`: throughput, then the terms that differ most."""
    m = result.metrics
    gain = m["tokens_per_s"][best] / m["tokens_per_s"][other] - 1
    parts = [f"{result.layout(best).short()} makes {gain:+.2%} tokens/s against {other_name} "
             f"({result.layout(other).short()})"]
    reasons = [_term_phrase(d) for d in term_deltas(m, best, other)[:2] if abs(d.saved_s) > 1e-9]
    if reasons:
        parts.append("; it spends " + " and ".join(reasons))
    if abs(gain) < TIE_PPM:
        memory_saved = m["peak_memory_bytes"][other] - m["peak_memory_bytes"][best]
        parts.append(f"; a tie on speed, decided by {memory_saved / 2**30:.1f} GiB less memory"
                     if memory_saved > 0 else "; a tie on speed and memory, decided by fewer moving parts")
    return "".join(parts)


def _term_phrase(delta: TermDelta) -> str:
    name = delta.term.replace("_comm", " communication").replace("_", " ")
    word = "less" if delta.saved_s > 0 else "more"
    amount = f"{abs(delta.saved_s):.1f} s" if abs(delta.saved_s) >= 10 else f"{abs(delta.saved_s) * 1e3:.1f} ms"
    return f"{amount} {word} on {name}"


# ---- nearest misses: what to change -----------------------------------------------------------
@dataclass(frozen=True)
class Suggestion:
    """One change to a layout that does not fit, with the memory it would need."""

    change: str
    layout: object  # Layout
    peak_memory_bytes: float
    capacity_bytes: float
    fits: bool


def memory_variants(layout) -> list[tuple[str, dict]]:
    """Single changes that lower memory per GPU, and all of them at once."""
    changes = []
    if layout.zero < 3 and layout.dp > 1:
        changes.append(("ZeRO-3", {"zero": 3}))
    if layout.recompute != "full":
        changes.append(("full recompute", {"recompute": "full"}))
    if layout.micro_batch > 1:
        changes.append(("micro-batch 1", {"micro_batch": 1}))
    if layout.tp > 1 and not layout.sequence_parallel:
        changes.append(("sequence parallel", {"sequence_parallel": True}))
    if layout.dp % 2 == 0:
        changes.append((f"pp {layout.pp * 2} (dp {layout.dp // 2})", {"pp": layout.pp * 2, "dp": layout.dp // 2}))
        changes.append((f"tp {layout.tp * 2} (dp {layout.dp // 2})", {"tp": layout.tp * 2, "dp": layout.dp // 2}))
    combined = {k: v for _, c in changes[:3] for k, v in c.items()}
    if len(changes) > 1 and combined:
        changes.append((" + ".join(label for label, _ in changes[:3]), combined))
    return changes


def suggestions(result: SearchResult, row: int) -> list[Suggestion]:
    """Evaluate the `memory_variants` of an evaluated row that are valid layouts."""
    return layout_suggestions(result.cluster, result.model, result.training, result.layout(row), result.orders,
                              result.engine)


def layout_suggestions(cluster, model, training, base, orders: tuple[str, ...] = (), engine=None) -> list[Suggestion]:
    """The `memory_variants` of one layout that are valid (and that `engine` can run), each with
    its predicted memory.

    Scalar `estimate()` per variant (a handful), so uneven `pp_layers` splits are handled too."""

    out = []
    for label, update in memory_variants(base):
        try:
            layout = Layout(**(base.model_dump() | update))
        except ValueError:
            continue  # e.g. doubling pp of an explicit pp_layers split
        if engine is not None:
            layout = engine.resolve_split(layout, model)
        if job_problems(layout, model, training, cluster.world_size, engine):
            continue
        est = estimate(cluster, model, training, layout, engine).to_dict()
        out.append(Suggestion(label, layout, float(est["peak_memory_bytes"]), float(est["capacity_bytes"]),
                              bool(est["fits"])))
    return out


def layout_warnings(result: SearchResult, row: int) -> list[str]:
    """What `plan3d estimate` warns of for a searched layout (a group spanning a slower tier, a
    ZeRO stage or GPU no calibration run had, ...): its scalar estimate's warnings, so that
    `recommend` and `explain` say what `estimate` would say of the same layout."""
    try:
        return estimate(result.cluster, result.model, result.training, result.layout(row), result.engine).warnings
    except LayoutError as err:  # the search ran it: a scalar refusal is a disagreement, said as such
        return [f"plan3d estimate refuses this layout: {err}"]


# ---- the verdict on one layout (plan3d check) -------------------------------------------------
@dataclass(frozen=True)
class Finding:
    """One line of a check: level 'error' fails it, 'warning' and 'notice' inform."""

    level: str
    message: str
    fix: str = ""


def fit_findings(est: dict, gpu_memory_bytes: float, min_mfu: float | None,
                 max_memory_fraction: float | None) -> list[Finding]:
    """Errors for a layout that does not fit with headroom or misses a threshold (SI in, text out):
    one per `plan3d.fit_rules.FIT_RULES` rule it fails, the rules the search applies."""
    broken = broken_fit_rules(FitFacts.of(est, gpu_memory_bytes), Thresholds(min_mfu, max_memory_fraction))
    return [Finding("error", sentence, rule.fix) for rule, sentence in broken]


def suggestion_findings(items: list[Suggestion]) -> list[Finding]:
    return [Finding("notice", f"with {s.change}: {s.peak_memory_bytes / 2**30:.1f} GiB per GPU "
                    f"({'fits' if s.fits else 'still over'})", s.layout.short()) for s in items]


@dataclass
class CheckReport:
    findings: list[Finding]
    estimate: dict | None = None
    recommended: dict | None = None
    engine: object = None  # the EngineSpec checked for
    conservative: bool = False  # thresholds judged at the slow end of the error band

    @property
    def ok(self) -> bool:
        return not any(f.level == "error" for f in self.findings)


def problem_finding(problem: str) -> Finding:
    """A layout_problems sentence 'what is wrong; what to change' as an error with its fix."""
    what, _, fix = problem.partition("; ")
    return Finding("error", what, fix)


def engine_finding(problem: str) -> Finding:
    """An engine's `layout_problems` sentence ('what: fix' or 'what; fix') as an error with its fix."""
    cut = max(problem.rfind("; "), problem.rfind(": "))
    return Finding("error", problem[:cut], problem[cut + 2:]) if cut > 0 else Finding("error", problem)


def check_job(cluster, model, training, layout, min_mfu: float | None = None,
              max_memory_fraction: float | None = None, engine=None, strict: bool = False,
              conservative: bool = False) -> CheckReport:
    """Is this job valid for `engine` and predicted to fit with headroom (and meet the thresholds)?
    Each error has a fix. `strict`: GPUs of the job that the layout leaves idle are an error.
    `conservative`: --min-mfu is judged at the slow end of the prediction's error band."""

    report = CheckReport([], engine=engine, conservative=conservative)
    if layout is None:
        report.findings.append(Finding("notice", "the job names no layout; checked that some layout fits",
                                       "add the recommended layout under `layout:`"))
    else:
        if engine is not None:
            layout = engine.resolve_split(layout, model)
            report.findings += [engine_finding(p) for p in engine.job_problems(layout, model, training)]
        report.findings += [problem_finding(p) for p in layout_problems(layout, model, training, cluster.world_size)]
        if report.ok:
            _check_fit(report, cluster, model, training, layout, min_mfu, max_memory_fraction, engine, strict)
    if layout is None or not report.ok:
        _recommend_instead(report, cluster, model, training, min_mfu, max_memory_fraction, engine)
    return report


def _check_fit(report: CheckReport, cluster, model, training, layout, min_mfu, max_memory_fraction,
               engine=None, strict: bool = False) -> None:

    est = estimate(cluster, model, training, layout, engine).to_dict()
    report.estimate = est
    judged = at_slow_end(est) if report.conservative else est
    errors = fit_findings(judged, cluster.gpu.memory_bytes, min_mfu, max_memory_fraction)
    if report.conservative and min_mfu is not None:
        report.findings.append(Finding("notice", f"--min-mfu judged at the slow end of the error band: MFU "
                                       f"{judged['mfu']:.1%} (predicted {est['mfu']:.1%})"))
    report.findings += errors
    if errors and (not est["fits"] or max_memory_fraction is not None):

        report.findings += suggestion_findings(layout_suggestions(cluster, model, training, layout, DEFAULT_ORDERS,
                                                                  engine))
    idle = idle_gpus_warning(layout.world_size, cluster.world_size)
    report.findings += [Finding("warning", w) for w in est.get("warnings", []) if w != idle]
    report.findings += band_findings(est)
    if idle:
        fix = "raise dp to use them all, or lower `nodes`" + ("" if strict else " (`--strict` fails on this)")
        report.findings.append(Finding("error" if strict else "warning", idle, fix))


def band_findings(est: dict) -> list[Finding]:
    """A notice for a prediction outside every region of measured runs, naming what it extrapolates."""
    region = est.get("region") or {}
    if est.get("validated", True) or not region:
        return []
    return [Finding("notice", f"the prediction is extrapolated ({region['name']}): "
                    + "; ".join(region.get("extrapolated", [])),
                    "judge thresholds at the slow end of the band with --conservative")]


def at_slow_end(est: dict) -> dict:
    """An estimate's rates at the slow end of its error band (step time its band's high end)."""
    band = est.get("step_time_s_band") or [est["step_time_s"]] * 2
    slow = est["step_time_s"] / band[1]
    rates = ("tokens_per_s", "model_tflops_per_gpu", *UTILISATION)
    return est | {"step_time_s": band[1], **{k: est[k] * slow for k in rates}}


def _recommend_instead(report: CheckReport, cluster, model, training, min_mfu, max_memory_fraction,
                       engine=None) -> None:

    result = search(cluster, model, training, min_mfu=min_mfu, max_memory_fraction=max_memory_fraction,
                    engine=engine)
    order = rank(result)
    if result.feasible_count:
        best = int(order[0])
        lay = result.layout(best)
        report.recommended = {"layout": lay.model_dump(mode="json", exclude={"pp_layers", "cp", "etp"} | _unit_ep(lay)),
                              "tokens_per_s": float(result.metrics["tokens_per_s"][best]),
                              "mfu": float(result.metrics["mfu"][best])}
        knobs = ", ".join(f"{k}: {json.dumps(v)}" for k, v in report.recommended["layout"].items())
        report.findings.append(Finding("notice", f"recommended for this job: {lay.short()} "
                                       f"({report.recommended['tokens_per_s']:,.0f} tokens/s, MFU "
                                       f"{report.recommended['mfu']:.1%})", f"layout: {{{knobs}}}"))
        return
    nodes = nodes_to_fit(cluster, model, training, min_mfu=min_mfu, max_memory_fraction=max_memory_fraction,
                         engine=engine)
    fix = f"use nodes: {nodes} (the smallest doubling or power of two that fits)" if nodes else \
        "no cluster up to 64x this size fits: a smaller model, shorter sequences or a bigger GPU"
    what = "fits" if result.size else "is even valid (the GPU count's factors do not divide heads, layers and batch)"
    flags = [f for f, v in (("--min-mfu", min_mfu), ("--max-memory-fraction", max_memory_fraction)) if v is not None]
    if flags and result.size:  # the thresholds, not memory alone, may be what rules every layout out
        what, fix = f"fits and meets {' and '.join(flags)}", f"relax {' / '.join(flags)}, or {fix}"
    report.findings.append(Finding("error", f"no layout of {model.name} on {cluster.world_size} "
                                   f"{cluster.gpu.name} GPUs {what}", fix))


def _unit_ep(layout) -> set[str]:
    """{"ep"} when the layout has no expert parallelism (the field is then left out of the JSON)."""
    return {"ep"} if layout.ep == 1 else set()
