"""The history of a run directory across launches: rank 0 appends and rewinds it (torch-free).

The file formats and their readers are the run record's (plan3d/run/record.py), re-exported here.

A run is trained by one or more launches, its segments: a first launch, then `--resume` (the same
layout) or `--resume-from` (any layout: a reshard). Rank 0 appends one line to `segments.jsonl`
when a segment starts (its first step, the checkpoint it resumed from, its layout, ...), and one
line per step to `metrics.jsonl`. A resume first drops what came after its checkpoint: the step
records after it, and the segments that started after it (their steps were rewound). Segment k
owns the steps from its first step up to the next segment's first step.

Worked example (killed at step 3 with a checkpoint at step 2, resumed to step 4):
  segments.jsonl  {"first_step": 1, "target_step": 4, ...}  {"first_step": 3, "resumed_from": ".../step_00000002", ...}
  metrics.jsonl   steps 1, 2 (of segment 1; its step 3 was dropped), 3, 4 (of segment 2)

A resume into a new run directory from another run's checkpoint (`--resume-from A/checkpoints/
step_N --run-dir B`) first copies A's history up to step N into B, with the plans its launches ran
(plans/), so B covers the whole run.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from plan3d.run.record import (METRICS, SEGMENTS, is_digest, plan_path, read_lines, read_metrics, read_segments,
                               segment_steps, summarize_segments)

__all__ = ["METRICS", "SEGMENTS", "read_metrics", "read_segments", "segment_steps", "summarize_segments",
           "rewind", "start_segment", "source_run_dir", "inherit"]


def _write_lines(path: Path, records: list[dict]) -> None:
    """Atomic rewrite (strict JSON: a NaN raises instead of being written)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text("".join(json.dumps(r, allow_nan=False) + "\n" for r in records))
    os.replace(tmp, path)


def _until(records: list[dict], key: str, last_step: int) -> list[dict]:
    return [r for r in records if isinstance(r.get(key), int) and r[key] <= last_step]


def rewind(run_dir: Path, last_step: int) -> None:
    """Keep the step records up to `last_step` and the segments that started by then."""
    run_dir = Path(run_dir)
    for name, key in ((METRICS, "step"), (SEGMENTS, "first_step")):
        path = run_dir / name
        if path.exists():
            _write_lines(path, _until(read_lines(path), key, last_step))


def start_segment(run_dir: Path, record: dict) -> None:
    """Append the record of a segment that starts now (after `rewind` to its checkpoint's step)."""
    with (Path(run_dir) / SEGMENTS).open("a") as f:
        f.write(json.dumps(record, allow_nan=False) + "\n")


def source_run_dir(resume_from: str | Path | None) -> Path | None:
    """The run directory a checkpoint belongs to: RUN itself, or RUN of RUN/checkpoints/step_N."""
    if not resume_from:
        return None
    path = Path(resume_from)
    if (path / "checkpoints").is_dir():
        return path
    if path.parent.name == "checkpoints":
        return path.parent.parent
    return None


def inherit(run_dir: Path, resume_from: str | Path | None, last_step: int) -> bool:
    """Copy the history of the run `resume_from` belongs to, up to `last_step`, into a run
    directory that has none of its own (a resume into a new directory), with the plans its
    segments name. True when copied."""
    run_dir, source = Path(run_dir), source_run_dir(resume_from)
    if source is None or source.resolve() == run_dir.resolve() or read_lines(run_dir / METRICS):
        return False
    steps = _until(read_lines(source / METRICS), "step", last_step)
    segments = _until(read_segments(source), "first_step", last_step)
    _write_lines(run_dir / METRICS, steps)
    _write_lines(run_dir / SEGMENTS, segments)
    _copy_plans(source, run_dir, segments)
    return bool(steps)


def _copy_plans(source: Path, run_dir: Path, segments: list[dict]) -> None:
    """The plans (plans/DIGEST.json) of the inherited segments, where the source has them."""
    for digest in {s.get("plan_digest") for s in segments if is_digest(s.get("plan_digest"))}:
        plan, copy = plan_path(source, digest), plan_path(run_dir, digest)
        if plan.is_file() and not copy.exists():
            copy.parent.mkdir(exist_ok=True)
            shutil.copyfile(plan, copy)
