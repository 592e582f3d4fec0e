"""Measured against predicted: read a launch's run directory and pair every term.

A run directory (written by `plan3d launch`, see plan3d/runtime/train.py) holds `plan.json`,
`metrics.jsonl` (one line per step), `summary.json` (mean step time after warm-up, per-rank
measured memory) and `logs/`. The prediction is the plan's own estimate, or a fresh estimate
under another cluster spec (e.g. one written by `plan3d calibrate`). A launch trains with plan3d's
own runtime, so the prediction is always for the `plan3d-runtime` engine: a plan made for another
engine (Megatron-Core, ...) is re-estimated, and the report says so.

What can be measured: step time and tokens/s (rank 0's wall clock), per-rank model-state bytes
(weights, gradients, optimizer states: exact tensor sizes) and per-rank peak memory (GPU: peak
allocated; CPU: peak resident set of the process, which includes the Python and torch runtime).
Rank 0 also times the phases of each step (`phases_s` in metrics.jsonl): the forward + backward
(compute, bubble, TP and PP traffic) and what follows it (gradient reduction, clipping, optimizer,
loss); the report pairs each with the predicted terms that fall in it. Single collectives are not
timed apart.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from plan3d.errors import SpecError, SpecNotFound
from plan3d.plan import Bytes, Plan, Rate, Seconds, load_plan
from plan3d.specs.base import Text
from plan3d.specs.loader import MAX_RUN_FILE_BYTES, check_file, read_text, validation_problems

REPORT_SCHEMA_VERSION = 1
STATE_KEYS = ("weights", "gradients", "optimizer")
COMM_KEYS = ("tp_comm", "pp_comm", "dp_comm", "zero_comm")
# Measured phases of a step (runtime/train.py PhaseClock) and the predicted terms inside each.
PHASES = (
    ("forward + backward (compute, bubble, TP/PP comm)", ("forward_backward",),
     ("compute", "recompute", "bubble", "tp_comm", "pp_comm", "overhead")),
    ("after the backward (DP/ZeRO comm, clip, optimizer, loss)", ("grad_reduce", "clip", "optimizer", "loss"),
     ("dp_comm", "zero_comm", "optimizer")),
)
MAX_STEPS = 10**12
Step = Annotated[int, Field(ge=0, le=MAX_STEPS)]


class RunRecord(BaseModel):
    """What `report` reads of a run file; other keys (losses, which may be NaN) pass unread.
    Every number it reads is finite and physical (times <= 1e9 s, bytes <= 1e18, plan.py), so no
    mean, sum or ratio of them overflows; text is one printable line."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class RankRecord(RunRecord):
    model_state_bytes: dict[str, Bytes] | None = None
    peak_memory_bytes: Bytes | None = None


class StepRecord(RunRecord):
    """One line of metrics.jsonl."""

    step: Step  # which launch (segment) a step belongs to
    step_time_s: Seconds
    tokens_per_s: Rate | None = None
    phases_s: dict[str, Seconds] | None = None


class SegmentRecord(RunRecord):
    """One line of segments.jsonl (runtime/train.py `_segment_record`)."""

    first_step: Annotated[int, Field(ge=1, le=MAX_STEPS)]
    target_step: Step | None = None
    resumed_at_step: Step | None = None
    resumed_from: Text | None = None
    layout: Text | None = None
    world_size: Annotated[int, Field(ge=1, le=10**9)] | None = None
    warmup_steps: Annotated[int, Field(ge=0, le=1_000_000_000)] = 1
    predicted_step_time_s: Seconds | None = None


class Summary(RunRecord):
    """summary.json (runtime/train.py `_summary`)."""

    step_time_s: Seconds
    tokens_per_s: Rate | None = None
    precision: Literal["bf16", "fp16", "fp8", "fp32"] | None = None
    backend: Text | None = None
    steps: Step | None = None
    warmup_steps: Annotated[int, Field(ge=0, le=1_000_000_000)] = 1
    incomplete: bool = False
    ranks: list[RankRecord | None] = []
    phases_s: dict[str, Seconds] = {}


@dataclass
class RunData:
    run_dir: Path
    plan: Plan
    summary: dict
    metrics: list[dict]
    segments: list[dict] = field(default_factory=list)  # runtime/history.py summarize_segments

    @property
    def last_segment_metrics(self) -> list[dict]:
        """The steps of the last launch: the layout of plan.json, which the prediction is for."""
        if not self.segments:
            return self.metrics
        return [m for m in self.metrics if m.get("step", 0) >= self.segments[-1]["first_step"]]

    @property
    def measured_step_s(self) -> float:
        return float(self.summary["step_time_s"])


def read_run(run_dir: Path | str) -> RunData:
    """The plan, summary and metrics of a run, each validated (a bad value is a SpecError naming
    the file and field); a run without summary falls back on its metrics."""
    run_dir = Path(run_dir)
    if not (run_dir / "plan.json").exists():
        raise SpecNotFound(f"{run_dir}: no plan.json; give the run directory that `plan3d launch` wrote")
    plan = load_plan(str(run_dir / "plan.json"))
    metrics = _read_metrics(run_dir / "metrics.jsonl")
    run = RunData(run_dir, plan, _read_summary(run_dir / "summary.json"), metrics, _segments(run_dir, metrics))
    last = run.last_segment_metrics
    if run.summary is None and last:
        timed = last[1:] or last  # the first step pays start-up costs
        run.summary = {"step_time_s": sum(m["step_time_s"] for m in timed) / len(timed), "ranks": [],
                       "steps": len(metrics), "incomplete": True, "warmup_steps": 1}
    elif run.summary is None:
        raise SpecError(str(run_dir), ["no summary.json and no metrics.jsonl: the run did not finish a step"])
    return run


def _segments(run_dir: Path, metrics: list[dict]) -> list[dict]:
    """Every launch of the run (segments.jsonl, each line validated, joined with the steps of
    metrics.jsonl), so a killed last launch without summary.json is shown too; none for a run
    from before segments."""
    from plan3d.runtime.history import SEGMENTS, read_segments, summarize_segments  # torch-free

    path = run_dir / SEGMENTS
    if path.exists():
        check_file(path, MAX_RUN_FILE_BYTES)  # a FIFO or a device there would never end
    segments = [_checked(SegmentRecord, s, f"{path}: segment {n}") for n, s in enumerate(read_segments(run_dir), 1)]
    return summarize_segments(segments, metrics)


def _read_summary(path: Path) -> dict | None:
    """summary.json validated, or None when it is missing or cut short (a killed run: not JSON, or
    without its step time): the metrics stand in."""
    if not path.exists():
        return None
    text = read_text(path, MAX_RUN_FILE_BYTES, errors="replace")  # a FIFO or a device: one error line
    try:
        summary = json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return None
    if not isinstance(summary, dict) or "step_time_s" not in summary:
        return None
    return _checked(Summary, summary, str(path))


def _read_metrics(path: Path) -> list[dict]:
    """One dict per step; a last line cut short by a killed run is dropped, a bad line before it is an error."""
    if not path.exists():
        return []
    lines = [line for line in read_text(path, MAX_RUN_FILE_BYTES, errors="replace").splitlines() if line.strip()]
    metrics = []
    for number, line in enumerate(lines, 1):
        try:
            step = json.loads(line)
        except (json.JSONDecodeError, RecursionError):
            step = None
        if isinstance(step, dict) and "step_time_s" in step:
            metrics.append(_checked(StepRecord, step, f"{path}: line {number}"))
        elif number < len(lines):
            raise SpecError(str(path), [f"line {number} is not a step record; was the file edited?"])
    return metrics


def _checked(model: type[RunRecord], record: dict, source: str) -> dict:
    """`record` validated as `model` (strictly: no strings for numbers); the keys `report` does
    not read stay as they are."""
    try:
        return {**record, **model.model_validate(record, strict=True).model_dump()}
    except ValidationError as err:
        raise SpecError(source, validation_problems(err)) from err


def predicted_estimate(run: RunData, cluster=None) -> dict:
    """The prediction for what the run did (`estimate_as_run`)."""
    return estimate_as_run(run.plan, run.summary.get("precision"), cluster)


def estimate_as_run(plan: Plan, precision: str | None, cluster=None) -> dict:
    """What plan3d's runtime is predicted to do with the plan: the plan's stored estimate when the
    run used the plan's precision, no other cluster is asked for and the estimate is of the
    runtime (or of no engine: plans from before engines, whose cluster-only values the runtime's
    profile leaves as they are); else a fresh estimate for the runtime engine in the run's
    precision (a CPU launch trains in fp32 whatever the plan assumed)."""
    from plan3d.specs.catalog import RUNTIME_ENGINE, load_engine

    precision = precision or plan.training.precision
    of_runtime = plan.estimate.get("engine", "") in ("", RUNTIME_ENGINE)
    if cluster is None and precision == plan.training.precision and plan.estimate.get("time_s") and of_runtime:
        return plan.estimate
    from plan3d.cost.estimate import estimate

    training = plan.training.model_copy(update={"precision": precision})
    return estimate(cluster or plan.cluster, plan.model, training, plan.layout, load_engine(RUNTIME_ENGINE)).to_dict()


def engine_note(plan: Plan) -> str | None:
    """A sentence when the plan was made for another engine than the runtime a launch trains with."""
    from plan3d.specs.catalog import RUNTIME_ENGINE

    made_for = plan.engine.name if plan.engine is not None else plan.estimate.get("engine", "")
    if not made_for or made_for == RUNTIME_ENGINE:
        return None
    return (f"the plan was made for {made_for}; plan3d launch trains with plan3d's own runtime, so the "
            f"predictions here are for {RUNTIME_ENGINE}")


SEGMENT_KEYS = ("first_step", "last_step", "steps", "resumed_at_step", "resumed_from", "layout", "world_size",
                "step_time_s", "predicted_step_time_s", "tokens_per_s", "train_time_s", "final_loss", "ended")


@dataclass
class Report:
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


def compare(run: RunData, cluster=None) -> Report:
    """Pair predicted and measured per term: step time, throughput, comm share, memory."""
    est = predicted_estimate(run, cluster)
    summary = run.summary
    step_pred = est["step_time_s"]
    rows = [row("step time", step_pred, summary.get("step_time_s"), "s"),
            row("tokens/s", est.get("tokens_per_s"), summary.get("tokens_per_s"), "tokens_per_s")]
    time_s = est.get("time_s", {})
    comm = sum(time_s.get(k, 0.0) for k in COMM_KEYS)
    rows.append(row("communication share of step", _finite(comm / step_pred) if step_pred else None, None, "ratio"))
    rows += _phase_rows(time_s, run.last_segment_metrics, int(summary.get("warmup_steps", 1)))
    rows += _memory_rows(est, summary.get("ranks") or [])
    _check_finite(rows, run)
    segments = [{k: s.get(k) for k in SEGMENT_KEYS} for s in run.segments]
    return Report(str(run.run_dir), run.plan.layout.short(), rows, _notes(run), dict(time_s), segments)


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
    for label, measured_keys, predicted_keys in PHASES:
        measured = sum(sum(p.get(k, 0.0) for k in measured_keys) for p in timed) / len(timed)
        rows.append(row(label, sum(time_s.get(k, 0.0) for k in predicted_keys), measured, "s"))
    return rows


def _memory_rows(est: dict, ranks: list[dict]) -> list[dict]:
    """Model states of the most-loaded rank per category, and the peak over ranks."""
    predicted = est.get("memory_bytes", {})
    states = [r["model_state_bytes"] for r in ranks if r and r.get("model_state_bytes")]
    rows = []
    for key in STATE_KEYS:
        measured = max((s.get(key, 0) for s in states), default=None)
        rows.append(row(f"{key} (most-loaded rank)", predicted.get(key), measured, "bytes"))
    peaks = [r["peak_memory_bytes"] for r in ranks if r and r.get("peak_memory_bytes")]
    rows.append(row("peak memory (most-loaded rank)", est.get("peak_memory_bytes"),
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
