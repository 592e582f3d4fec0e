"""The run package: the record a run directory keeps (measurements only) and the one compare()."""
from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from plan3d.cli import main
from plan3d.cost.estimate import estimate
from plan3d.layout import Layout
from plan3d.plan import build_plan, load_plan, save_plan
from plan3d.run.compare import compare
from plan3d.run.record import plan_path, read_run
from plan3d.specs.catalog import load_cluster, load_model
from plan3d.specs.training import TrainingSpec

ROOT = Path(__file__).resolve().parents[1]


def plan_of(tp: int, pp: int, dp: int):
    cluster, model = load_cluster("local-cpu"), load_model("tiny-gpt")
    training, layout = TrainingSpec(global_batch=16, precision="fp32"), Layout(tp=tp, pp=pp, dp=dp)
    return build_plan(cluster, model, training, layout, estimate(cluster, model, training, layout).to_dict())


def write_jsonl(path: Path, records: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def a_run(run_dir: Path, plan, summary: dict | None = None):
    save_plan(plan, run_dir / "plan.json")
    write_jsonl(run_dir / "metrics.jsonl", [{"step": s, "loss": 5.0, "step_time_s": 0.5, "tokens_per_s": 1.0}
                                            for s in (1, 2, 3, 4)])
    summary = {"step_time_s": 0.5, "precision": "fp32", "backend": "gloo", "ranks": [], **(summary or {})}
    (run_dir / "summary.json").write_text(json.dumps(summary))


def test_an_old_summary_with_a_prediction_reads_and_its_prediction_is_ignored(tmp_path):
    plan = plan_of(2, 2, 2)
    a_run(tmp_path, plan, {"predicted": {"step_time_s": 123.0, "peak_memory_bytes": 1e30, "engine": "x\ny"}})
    run = read_run(tmp_path)
    assert "predicted" not in run.summary
    step = compare(run).rows[0]
    assert step["term"] == "step time" and step["predicted"] == pytest.approx(plan.estimate.step_time_s)


def test_each_launch_is_predicted_from_the_plan_it_ran(tmp_path):
    """A reshard: segment 1 ran tp4 dp2 (its plan kept under plans/), segment 2 plan.json's tp2 pp2 dp2."""
    first, last = plan_of(4, 1, 2), plan_of(2, 2, 2)
    a_run(tmp_path, last)
    plan_path(tmp_path, first.digest).parent.mkdir()
    save_plan(first, plan_path(tmp_path, first.digest))
    write_jsonl(tmp_path / "segments.jsonl", [
        {"first_step": 1, "target_step": 4, "layout": first.layout.short(), "precision": "fp32",
         "plan_digest": first.digest},
        {"first_step": 3, "target_step": 4, "resumed_at_step": 2, "layout": last.layout.short(), "precision": "fp32",
         "plan_digest": last.digest}])
    one, two = compare(read_run(tmp_path)).segments
    assert one["predicted_step_time_s"] == pytest.approx(first.estimate.step_time_s)
    assert two["predicted_step_time_s"] == pytest.approx(last.estimate.step_time_s)
    assert one["predicted_step_time_s"] != pytest.approx(two["predicted_step_time_s"])


def test_a_launch_whose_plan_is_gone_has_no_prediction_and_an_old_segment_keeps_its_own(tmp_path):
    a_run(tmp_path, plan_of(2, 2, 2))
    write_jsonl(tmp_path / "segments.jsonl", [
        {"first_step": 1, "target_step": 4, "plan_digest": "0123456789abcdef"},
        {"first_step": 3, "target_step": 4, "predicted_step_time_s": 0.25}])  # written before plans/
    one, two = compare(read_run(tmp_path)).segments
    assert one["predicted_step_time_s"] is None and two["predicted_step_time_s"] == 0.25


@pytest.mark.parametrize("digest", ["../../plan", "ABC", "a" * 65])
def test_a_segment_digest_that_is_no_file_name_is_one_error_line(tmp_path, capsys, digest):
    a_run(tmp_path, plan_of(2, 2, 2))
    write_jsonl(tmp_path / "segments.jsonl", [{"first_step": 1, "plan_digest": digest}])
    with pytest.raises(SystemExit) as info:
        main(["report", str(tmp_path)])
    err = capsys.readouterr().err
    assert info.value.code == 2 and err.startswith("error: ") and "segment 1" in err and "plan_digest" in err


def test_the_launcher_keeps_the_plan_of_every_launch_by_its_digest(tmp_path):
    from plan3d.run.launch import prepare_run_dir

    first, second = plan_of(4, 1, 2), plan_of(2, 2, 2)
    prepare_run_dir(first, tmp_path)
    prepare_run_dir(second, tmp_path)
    assert load_plan(str(tmp_path / "plan.json")).digest == second.digest
    kept = sorted(p.name for p in (tmp_path / "plans").iterdir())
    assert kept == sorted(f"{p.digest}.json" for p in (first, second))
    assert load_plan(str(plan_path(tmp_path, first.digest))).layout == first.layout


def _module_file(name: str) -> Path | None:
    base = ROOT.joinpath(*name.split("."))
    return next((f for f in (base.with_suffix(".py"), base / "__init__.py") if f.is_file()), None)


def _plan3d_imports(name: str) -> set[str]:
    """Every plan3d module `name` imports, at module level or inside a function (and their packages)."""
    found = set()
    for node in ast.walk(ast.parse(_module_file(name).read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    modules = set()
    for imported in (m for m in found if m.split(".")[0] == "plan3d"):
        parts = imported.split(".")
        modules |= {".".join(parts[:i]) for i in range(1, len(parts) + 1) if _module_file(".".join(parts[:i]))}
    return modules


def test_the_runtime_reaches_no_prediction_code_even_through_other_modules():
    """Transitively, function-level imports included: the runtime records, it never predicts."""
    start = [f"plan3d.runtime.{p.stem}" for p in (ROOT / "plan3d" / "runtime").glob("*.py")]
    came_from = dict.fromkeys(start)
    todo = list(start)
    while todo:
        module = todo.pop()
        for imported in _plan3d_imports(module) - came_from.keys():
            came_from[imported] = module
            todo.append(imported)
    assert "plan3d.run.record" in came_from  # the walk follows the runtime's imports (history -> record)
    for banned in ("plan3d.cost", "plan3d.run.compare"):
        reached = [m for m in came_from if m == banned or m.startswith(banned + ".")]
        chain = [reached[0]] if reached else []
        while chain and came_from[chain[-1]]:
            chain.append(came_from[chain[-1]])
        assert not reached, " <- ".join(chain)
