"""The record of a run: what `plan3d launch` and the runtime write into a run directory.

A run directory holds:
  plan.json             the plan of the last launch (written by the launcher, plan3d/run/launch.py)
  plans/DIGEST.json     the plan of every launch, by its digest (a reshard changes the layout)
  metrics.jsonl         one StepRecord per step (rank 0, plan3d/runtime/train.py `Runner.step`)
  segments.jsonl        one SegmentRecord per launch (rank 0, `_segment_record`; history below)
  summary.json          one Summary at the end of a launch (rank 0, `_summary`), RankRecord per rank
  logs/, errors/, checkpoints/

Measurements and identities only: step times, phases, bytes, losses, which plan (its digest) a
launch ran. No prediction is written here; plan3d/run/compare.py predicts from the plan. Files
written before that rule (summary.json with a "predicted" key, segments with
`predicted_step_time_s`) still read: the summary's key is ignored, a segment's is used only when
its plan cannot be found.

Segments: a run is trained by one or more launches: a first one, then `--resume` (same layout) or
`--resume-from` (any layout: a reshard). Segment k owns the steps from its first step up to the
next segment's first step (plan3d/runtime/history.py writes and rewinds them).

This module imports neither torch nor the cost model: the runtime imports it for the file names
and the history readers.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from plan3d.errors import SpecError, SpecNotFound
from plan3d.plan import Bytes, Plan, Rate, Seconds, load_plan
from plan3d.specs.base import Text
from plan3d.specs.loader import MAX_RUN_FILE_BYTES, check_file, read_text, validation_problems

PLAN = "plan.json"
PLANS = "plans"  # plans/<digest>.json: the plan of each launch
METRICS = "metrics.jsonl"
SEGMENTS = "segments.jsonl"
SUMMARY = "summary.json"
LEGACY_SUMMARY_KEYS = ("predicted",)  # written by runtimes before plan3d/run: ignored on read
MAX_STEPS = 10**12
Step = Annotated[int, Field(ge=0, le=MAX_STEPS)]
Count = Annotated[int, Field(ge=0, le=1_000_000_000)]
DIGEST_PATTERN = r"^[0-9a-f]{1,64}$"  # plan.py digest_of: hex, so a file name under plans/ and nothing else
Digest = Annotated[str, Field(pattern=DIGEST_PATTERN)]


class RunRecord(BaseModel):
    """What plan3d reads of a run file; other keys (losses, which may be NaN) pass unread.
    Every number it reads is finite and physical (times <= 1e9 s, bytes <= 1e18, plan.py), so no
    mean, sum or ratio of them overflows; text is one printable line."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class RankRecord(RunRecord):
    """One rank's memory, in summary.json's `ranks` (model states: exact tensor bytes; peak: GPU
    peak allocated, or the CPU process's peak resident set)."""

    model_state_bytes: dict[str, Bytes] | None = None
    peak_memory_bytes: Bytes | None = None


class StepRecord(RunRecord):
    """One line of metrics.jsonl: rank 0's wall clock, and its phases (runtime/train.py PhaseClock)."""

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
    precision: Literal["bf16", "fp16", "fp8", "fp32"] | None = None
    warmup_steps: Count = 1
    plan_digest: Digest | None = None
    predicted_step_time_s: Seconds | None = None  # legacy: written by runtimes before plan3d/run


class Summary(RunRecord):
    """summary.json (runtime/train.py `_summary`)."""

    step_time_s: Seconds
    tokens_per_s: Rate | None = None
    precision: Literal["bf16", "fp16", "fp8", "fp32"] | None = None
    backend: Text | None = None
    steps: Step | None = None
    warmup_steps: Count = 1
    incomplete: bool = False
    ranks: list[RankRecord | None] = []
    phases_s: dict[str, Seconds] = {}


# ---- the history files (.jsonl), as the runtime writes them ----------------------------------
def read_lines(path: Path) -> list[dict]:
    """The JSON objects of a .jsonl file; a last line cut short by a killed run is left out."""
    if not path.is_file():
        return []
    records = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def read_metrics(run_dir: Path) -> list[dict]:
    """Every step record of metrics.jsonl, in order."""
    return [m for m in read_lines(Path(run_dir) / METRICS) if isinstance(m.get("step"), int)]


def read_segments(run_dir: Path) -> list[dict]:
    """The segment records of a run directory, oldest first (none for a run from before segments)."""
    return read_lines(Path(run_dir) / SEGMENTS)


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def segment_steps(segments: list[dict], metrics: list[dict], index: int) -> list[dict]:
    """The step records of segment `index` (from its first step to the next segment's)."""
    first = segments[index]["first_step"]
    end = segments[index + 1]["first_step"] if index + 1 < len(segments) else float("inf")
    return [m for m in metrics if first <= m.get("step", 0) < end]


def summarize_segments(segments: list[dict], metrics: list[dict]) -> list[dict]:
    """Each segment's record with its own steps and timing: `steps`, `last_step`, `step_time_s`
    and `tokens_per_s` (means without its first `warmup_steps`), `train_time_s` (sum of its step
    times), `final_loss`, and `ended`: completed (reached its --steps) or interrupted."""
    out = []
    for index, segment in enumerate(segments):
        steps = segment_steps(segments, metrics, index)
        timed = steps[int(segment.get("warmup_steps", 1)):] or steps
        last = steps[-1]["step"] if steps else None
        out.append({**segment, "steps": len(steps), "last_step": last,
                    "step_time_s": _mean([m["step_time_s"] for m in timed]),
                    "tokens_per_s": _mean([m["tokens_per_s"] for m in timed if "tokens_per_s" in m]),
                    "train_time_s": sum(m["step_time_s"] for m in steps),
                    "final_loss": steps[-1].get("loss") if steps else None,
                    "ended": "completed" if last is not None and last == segment.get("target_step") else "interrupted"})
    return out


def is_digest(value) -> bool:
    """A plan digest (hex): safe as a file name under plans/."""
    return isinstance(value, str) and re.fullmatch(DIGEST_PATTERN, value) is not None


def plan_path(run_dir: Path, digest: str) -> Path:
    """Where the launcher keeps the plan of the launch with this digest."""
    if not is_digest(digest):
        raise ValueError(f"not a plan digest: {digest!r}")
    return Path(run_dir) / PLANS / f"{digest}.json"


# ---- a whole run, validated -------------------------------------------------------------------
@dataclass
class RunData:
    """A run directory read and validated: plan.json, summary.json (or its stand-in from the
    metrics), every step and every segment. Dicts of validated values; keys plan3d does not read
    pass as written."""

    run_dir: Path
    plan: Plan
    summary: dict
    metrics: list[dict]
    segments: list[dict] = field(default_factory=list)  # summarize_segments

    @property
    def last_segment_metrics(self) -> list[dict]:
        """The steps of the last launch: the layout of plan.json, which the prediction is for."""
        if not self.segments:
            return self.metrics
        return [m for m in self.metrics if m.get("step", 0) >= self.segments[-1]["first_step"]]

    @property
    def measured_step_s(self) -> float:
        return float(self.summary["step_time_s"])

    def segment_plan(self, segment: dict) -> Plan | None:
        """The plan a segment ran (plan.json's, or plans/DIGEST.json); None when it names none or
        the file is gone (a run from before plans/)."""
        digest = segment.get("plan_digest")
        if not digest:
            return None
        if digest == self.plan.digest:
            return self.plan
        path = plan_path(self.run_dir, digest)
        return load_plan(str(path)) if path.exists() else None


def read_run(run_dir: Path | str) -> RunData:
    """The plan, summary and metrics of a run, each validated (a bad value is a SpecError naming
    the file and field); a run without summary falls back on its metrics."""
    run_dir = Path(run_dir)
    if not (run_dir / PLAN).exists():
        raise SpecNotFound(f"{run_dir}: no plan.json; give the run directory that `plan3d launch` wrote")
    plan = load_plan(str(run_dir / PLAN))
    metrics = _read_metrics(run_dir / METRICS)
    run = RunData(run_dir, plan, _read_summary(run_dir / SUMMARY), metrics, _segments(run_dir, metrics))
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
    path = run_dir / SEGMENTS
    if path.exists():
        check_file(path, MAX_RUN_FILE_BYTES)  # a FIFO or a device there would never end
    segments = [_checked(SegmentRecord, s, f"{path}: segment {n}") for n, s in enumerate(read_segments(run_dir), 1)]
    return summarize_segments(segments, metrics)


def _read_summary(path: Path) -> dict | None:
    """summary.json validated, or None when it is missing or cut short (a killed run: not JSON, or
    without its step time): the metrics stand in. A legacy "predicted" key is dropped."""
    if not path.exists():
        return None
    text = read_text(path, MAX_RUN_FILE_BYTES, errors="replace")  # a FIFO or a device: one error line
    try:
        summary = json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return None
    if not isinstance(summary, dict) or "step_time_s" not in summary:
        return None
    measured = {k: v for k, v in summary.items() if k not in LEGACY_SUMMARY_KEYS}
    return _checked(Summary, measured, str(path))


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
    """`record` validated as `model` (strictly: no strings for numbers); the keys plan3d does
    not read stay as they are."""
    try:
        return {**record, **model.model_validate(record, strict=True).model_dump()}
    except ValidationError as err:
        raise SpecError(source, validation_problems(err)) from err
