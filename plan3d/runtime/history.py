"""The history of a run directory across launches (torch-free: the ranks and `plan3d report` read it).

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
step_N --run-dir B`) first copies A's history up to step N into B, so B covers the whole run.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

SEGMENTS = "segments.jsonl"
METRICS = "metrics.jsonl"


def _read_lines(path: Path) -> list[dict]:
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


def _write_lines(path: Path, records: list[dict]) -> None:
    """Atomic rewrite (strict JSON: a NaN raises instead of being written)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text("".join(json.dumps(r, allow_nan=False) + "\n" for r in records))
    os.replace(tmp, path)


def read_metrics(run_dir: Path) -> list[dict]:
    """Every step record of metrics.jsonl, in order."""
    return [m for m in _read_lines(Path(run_dir) / METRICS) if isinstance(m.get("step"), int)]


def read_segments(run_dir: Path) -> list[dict]:
    """The segment records of a run directory, oldest first (none for a run from before segments)."""
    return _read_lines(Path(run_dir) / SEGMENTS)


def _until(records: list[dict], key: str, last_step: int) -> list[dict]:
    return [r for r in records if isinstance(r.get(key), int) and r[key] <= last_step]


def rewind(run_dir: Path, last_step: int) -> None:
    """Keep the step records up to `last_step` and the segments that started by then."""
    run_dir = Path(run_dir)
    for name, key in ((METRICS, "step"), (SEGMENTS, "first_step")):
        path = run_dir / name
        if path.exists():
            _write_lines(path, _until(_read_lines(path), key, last_step))


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
    directory that has none of its own (a resume into a new directory). True when copied."""
    run_dir, source = Path(run_dir), source_run_dir(resume_from)
    if source is None or source.resolve() == run_dir.resolve() or _read_lines(run_dir / METRICS):
        return False
    steps = _until(_read_lines(source / METRICS), "step", last_step)
    _write_lines(run_dir / METRICS, steps)
    _write_lines(run_dir / SEGMENTS, _until(read_segments(source), "first_step", last_step))
    return bool(steps)


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
