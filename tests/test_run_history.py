"""The history of a run directory across launches (plan3d/runtime/history.py, torch-free)."""
from __future__ import annotations

import json

from plan3d.runtime import history


def _steps(run_dir, steps):
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 1.0, "step_time_s": 0.5}) + "\n"
                                                   for s in steps))


def test_rewind_drops_the_steps_and_segments_after_the_checkpoint(tmp_path):
    _steps(tmp_path, [1, 2, 3, 4, 5])
    for first in (1, 3, 5):
        history.start_segment(tmp_path, {"first_step": first})
    history.rewind(tmp_path, 3)
    assert [m["step"] for m in history.read_metrics(tmp_path)] == [1, 2, 3]
    assert [s["first_step"] for s in history.read_segments(tmp_path)] == [1, 3]


def test_a_resume_into_a_new_directory_inherits_the_history_up_to_its_checkpoint(tmp_path):
    source, target = tmp_path / "a", tmp_path / "b"
    source.mkdir(), target.mkdir()
    (source / "checkpoints").mkdir()
    _steps(source, [1, 2, 3, 4])
    history.start_segment(source, {"first_step": 1})
    history.start_segment(source, {"first_step": 4})
    assert history.inherit(target, source / "checkpoints" / "step_00000002", 2)
    assert [m["step"] for m in history.read_metrics(target)] == [1, 2]
    assert [s["first_step"] for s in history.read_segments(target)] == [1]
    assert not history.inherit(target, source / "checkpoints" / "step_00000002", 2)  # it has a history now
    assert not history.inherit(source, source, 2)  # resuming in place copies nothing


def test_a_standalone_checkpoint_brings_no_history(tmp_path):
    (tmp_path / "ckpt").mkdir()
    assert history.source_run_dir(tmp_path / "ckpt") is None
    assert not history.inherit(tmp_path / "new", tmp_path / "ckpt", 2)


def test_segments_own_the_steps_up_to_the_next_one(tmp_path):
    records = [{"step": s, "loss": 10.0 - s, "step_time_s": float(s), "tokens_per_s": 1.0} for s in range(1, 7)]
    segments = [{"first_step": 1, "target_step": 6, "warmup_steps": 1}, {"first_step": 4, "target_step": 6, "warmup_steps": 0}]
    first, second = history.summarize_segments(segments, records)
    assert (first["steps"], first["last_step"], first["ended"], first["step_time_s"]) == (3, 3, "interrupted", 2.5)
    assert (second["steps"], second["last_step"], second["ended"], second["step_time_s"]) == (3, 6, "completed", 5.0)
    assert second["final_loss"] == 4.0 and second["train_time_s"] == 15.0


def test_an_inherited_history_brings_the_plans_its_launches_ran(tmp_path):
    source, target = tmp_path / "a", tmp_path / "b"
    (source / "checkpoints").mkdir(parents=True), target.mkdir()
    (source / "plans").mkdir()
    _steps(source, [1, 2, 3, 4])
    for first, digest in ((1, "00aa"), (3, "00bb")):
        (source / "plans" / f"{digest}.json").write_text(f'{{"plan": "{digest}"}}')
        history.start_segment(source, {"first_step": first, "plan_digest": digest})
    history.start_segment(source, {"first_step": 2, "plan_digest": "../../escape"})  # never a path
    assert history.inherit(target, source / "checkpoints" / "step_00000002", 2)
    assert sorted(p.name for p in (target / "plans").iterdir()) == ["00aa.json"]  # segment 3 came later
    assert (target / "plans" / "00aa.json").read_text() == '{"plan": "00aa"}'
