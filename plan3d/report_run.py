"""Measured against predicted, under its former module name: the run record and `compare()` now
live in plan3d/run/ (record.py: the files of a run directory; compare.py: the one pairing).
Kept so callers of `plan3d.report_run` (calibrate --from-run, older scripts) keep working."""
from __future__ import annotations

from plan3d.run.compare import (COMM_KEYS, PHASE_PAIRS, REPORT_SCHEMA_VERSION, SEGMENT_KEYS, STATE_KEYS, Comparison,
                                compare, engine_note, prediction_error, row)
from plan3d.run.compare import predicted_for_run as estimate_as_run
from plan3d.run.record import RankRecord, RunData, SegmentRecord, StepRecord, Summary, read_run

Report = Comparison
PHASES = PHASE_PAIRS  # the name compare.py gave its pairing table before plan3d.vocab

__all__ = ["COMM_KEYS", "PHASES", "REPORT_SCHEMA_VERSION", "SEGMENT_KEYS", "STATE_KEYS", "Comparison", "Report",
           "RankRecord", "RunData", "SegmentRecord", "StepRecord", "Summary", "compare", "engine_note",
           "estimate_as_run", "prediction_error", "read_run", "row"]
