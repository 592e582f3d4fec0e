"""Measured against predicted: the one place a prediction meets a run's record.

The prediction is the plan's own estimate, or a fresh one of what the run did: a launch trains
with plan3d's own runtime, so a plan made for another engine (Megatron-Core, ...) is re-estimated
for the `plan3d-runtime` engine, as is a run that trained in another precision than the plan
assumed (a CPU launch trains in fp32), or one asked to be seen under another cluster spec (e.g. one
written by `plan3d calibrate`). `plan3d launch` and `plan3d report` both print `compare()`'s rows.

One convention: error = predicted / measured - 1 (+10% = predicted 10% above what was measured).

What can be measured: step time and tokens/s (rank 0's wall clock), per-rank model-state bytes
(weights, gradients, optimizer states: exact tensor sizes) and per-rank peak memory (GPU: peak
allocated; CPU: peak resident set of the process, which includes the Python and torch runtime).
Rank 0 also times the phases of each step (`phases_s` in metrics.jsonl): the forward + backward
(compute, bubble, TP and PP traffic) and what follows it (gradient reduction, clipping, optimizer,
loss); each is paired with the predicted terms that fall in it. Single collectives are not timed
apart.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from plan3d.cost.estimate import estimate
from plan3d.plan import Estimate, Plan
from plan3d.run.record import RunData
from plan3d.specs.catalog import RUNTIME_ENGINE, load_engine
from plan3d.vocab import COMM_TERMS, MODEL_STATE_TERMS, PHASES, TIME_TERMS

REPORT_SCHEMA_VERSION = 1
STATE_KEYS = MODEL_STATE_TERMS
COMM_KEYS = COMM_TERMS
# Measured phases of a step (plan3d.vocab.PHASES, timed by runtime/train.py PhaseClock) and the
# predicted time terms inside each: every phase and every term in exactly one row, in step order.
PHASE_PAIRS = (
    ("forward + backward (compute, bubble, TP/PP comm)", PHASES[:1], TIME_TERMS[:TIME_TERMS.index("dp_comm")]),
    ("after the backward (DP/ZeRO comm, clip, optimizer, loss)", PHASES[1:],
     TIME_TERMS[TIME_TERMS.index("dp_comm"):]),
)
SEGMENT_KEYS = ("first_step", "last_step", "steps", "resumed_at_step", "resumed_from", "layout", "world_size",
                "step_time_s", "predicted_step_time_s", "tokens_per_s", "train_time_s", "final_loss", "ended")


# ---- the prediction for a run -------------------------------------------------------------------
def predicted_for_run(plan: Plan, precision: str | None = None, cluster=None) -> Estimate:
    """What plan3d's runtime is predicted to do with the plan: the plan's stored estimate when the
    run used the plan's precision, no other cluster is asked for and the estimate is of the
    runtime (or of no engine: plans from before engines, whose cluster-only values the runtime's
    profile leaves as they are); else a fresh estimate for the runtime engine in the run's
    precision (a CPU launch trains in fp32 whatever the plan assumed)."""
    precision, stored = precision or plan.training.precision, plan.estimate
    of_runtime = stored is not None and stored.engine in ("", RUNTIME_ENGINE)
    if cluster is None and precision == plan.training.precision and of_runtime and stored.time_s:
        return stored
    training = plan.training.model_copy(update={"precision": precision})
    runtime = load_engine(RUNTIME_ENGINE)
    if plan.layout.cp > 1 and plan.cp_comm in runtime.can_run.cp_comm:  # the exchange the runtime runs (launch)
        runtime = runtime.with_cp_comm(plan.cp_comm)
    fresh = estimate(cluster or plan.cluster, plan.model, training, plan.layout, runtime)
    return fresh


def engine_note(plan: Plan) -> str | None:
    """A sentence when the plan was made for another engine than the runtime a launch trains with."""
    made_for = plan.engine.name if plan.engine is not None else plan.estimate.engine if plan.estimate else ""
    if not made_for or made_for == RUNTIME_ENGINE:
        return None
    return (f"the plan was made for {made_for}; plan3d launch trains with plan3d's own runtime, so the "
            f"predictions here are for {RUNTIME_ENGINE}")


# ---- pairing ------------------------------------------------------------------------------------
def prediction_error(predicted: float | None, measured: float | None) -> float | None:
    """predicted / measured - 1: the one convention of `launch`, `report` and the accuracy
    benchmarks (+10% = predicted 10% above what was measured); None when either is missing (or
    the measurement is so close to 0 that the ratio is no number)."""
    return _finite(predicted / measured - 1) if predicted is not None and measured else None


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


def row(term: str, predicted: float | None, measured: float | None, unit: str) -> dict:
    """One paired term; `error` = predicted / measured - 1 (the prediction's relative error) when both exist."""
    error = prediction_error(predicted, measured)
    return {"term": term, "predicted": predicted, "measured": measured, "unit": unit, "error": error}


@dataclass
class Comparison:
    """Every paired term of a run (`rows`), the predicted step breakdown, the launches (segments,
    each with its own predicted step time) and notes on what the pairing means."""

    run_dir: str
    layout: str
    rows: list[dict]
    notes: list[str] = field(default_factory=list)
    predicted_time_s: dict = field(default_factory=dict)
    segments: list[dict] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"schema_version": REPORT_SCHEMA_VERSION, "run_dir": self.run_dir, "layout": self.layout,
                "rows": self.rows, "predicted_time_s": self.predicted_time_s, "notes": self.notes,
                "segments": self.segments}


def compare(run: RunData, cluster=None) -> Comparison:
    """Pair predicted and measured per term: step time, throughput, comm share, phases, memory."""
    est = predicted_for_run(run.plan, run.summary.get("precision"), cluster)
    summary = run.summary
    step_pred = est.step_time_s
    rows = [row("step time", step_pred, summary.get("step_time_s"), "s"),
            row("tokens/s", est.tokens_per_s, summary.get("tokens_per_s"), "tokens_per_s")]
    time_s = est.time_s
    comm = sum(time_s.get(k, 0.0) for k in COMM_KEYS)
    rows.append(row("communication share of step", _finite(comm / step_pred) if step_pred else None, None, "ratio"))
    rows += _phase_rows(time_s, run.last_segment_metrics, int(summary.get("warmup_steps", 1)))
    rows += _memory_rows(est, summary.get("ranks") or [])
    _check_finite(rows, run)
    return Comparison(str(run.run_dir), run.plan.layout.short(), rows, _notes(run), dict(time_s),
                      _segments(run, cluster))


def _segments(run: RunData, cluster) -> list[dict]:
    """Each launch with its measured timing and the step time predicted for the plan it ran."""
    return [{**{k: s.get(k) for k in SEGMENT_KEYS}, "predicted_step_time_s": _segment_prediction(run, s, cluster)}
            for s in run.segments]


def _segment_prediction(run: RunData, segment: dict, cluster) -> float | None:
    """The predicted step time of the plan a segment ran, in the precision it trained in; a
    segment from before plans/ carries its own (written by older runtimes)."""
    plan = run.segment_plan(segment)
    if plan is None:
        return segment.get("predicted_step_time_s")
    return predicted_for_run(plan, segment.get("precision"), cluster).step_time_s


def _check_finite(rows: list[dict], run: RunData) -> None:
    """Every value of the table is a finite number: the bounds of the run files and of the plan's
    estimate make a sum or mean past them impossible, so this names a broken bound, not bad input."""
    for r in rows:
        for key in ("predicted", "measured"):
            value = r[key]
            assert value is None or math.isfinite(value), f"{run.run_dir}: {r['term']} {key} is {value}"


def _phase_rows(time_s: dict, metrics: list[dict], warmup: int) -> list[dict]:
    """Each measured phase (rank 0, mean over the steps after warm-up) against the predicted
    terms that fall in it; nothing when the run predates phase timing."""
    timed = [m["phases_s"] for m in (metrics[warmup:] or metrics) if isinstance(m.get("phases_s"), dict)]
    if not timed or not time_s:
        return []
    rows = []
    for label, measured_keys, predicted_keys in PHASE_PAIRS:
        measured = sum(sum(p.get(k, 0.0) for k in measured_keys) for p in timed) / len(timed)
        rows.append(row(label, sum(time_s.get(k, 0.0) for k in predicted_keys), measured, "s"))
    return rows


def _memory_rows(est: Estimate, ranks: list[dict]) -> list[dict]:
    """Model states of the most-loaded rank per category, and the peak over ranks."""
    predicted = est.memory_bytes
    states = [r["model_state_bytes"] for r in ranks if r and r.get("model_state_bytes")]
    rows = []
    for key in STATE_KEYS:
        measured = max((s.get(key, 0) for s in states), default=None)
        rows.append(row(f"{key} (most-loaded rank)", predicted.get(key), measured, "bytes"))
    peaks = [r["peak_memory_bytes"] for r in ranks if r and r.get("peak_memory_bytes")]
    rows.append(row("peak memory (most-loaded rank)", est.peak_memory_bytes,
                    max(peaks) if peaks else None, "bytes"))
    return rows


def _notes(run: RunData) -> list[str]:
    notes = ["phases are rank 0's wall clock; single collectives are not timed apart, so the communication share is predicted only"]
    summary, plan = run.summary, run.plan
    if engine_note(plan):
        notes.append(engine_note(plan))
    if len(run.segments) > 1:
        notes.append(f"the run was trained in {len(run.segments)} launches (segments); the rows above are the last "
                     f"one's (steps {run.segments[-1]['first_step']}.., layout {run.segments[-1]['layout']})")
    if summary.get("incomplete"):
        notes.append("the run wrote no summary.json (or one cut short): step time is the mean of metrics.jsonl without its first step")
    if summary.get("precision") and summary["precision"] != plan.training.precision:
        notes.append(f"the run trained in {summary['precision']}, the plan assumed {plan.training.precision}: "
                     f"predictions are recomputed for {summary['precision']}")
    if summary.get("backend") == "gloo":
        notes.append("CPU run: peak memory is the process's resident set (Python and torch included), "
                     "not comparable with the plan's device-memory terms")
    return notes
