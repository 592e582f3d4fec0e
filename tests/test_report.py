"""Measured vs predicted: a run directory in the runtime's format, read, paired and rendered."""
from __future__ import annotations

import json

import pytest

from plan3d.cli import main
from plan3d.cost.estimate import estimate
from plan3d.layout import Layout
from plan3d.plan import build_plan, save_plan
from plan3d.run.compare import compare
from plan3d.run.record import read_run
from plan3d.specs.catalog import load_cluster, load_model
from plan3d.specs.training import TrainingSpec


def make_run(tmp_path, measured_scale=1.1, with_summary=True):
    cluster, model = load_cluster("local-cpu"), load_model("tiny-gpt")
    training, layout = TrainingSpec(global_batch=16, precision="fp32"), Layout(tp=2, pp=2, dp=2)
    est = estimate(cluster, model, training, layout).to_dict()
    save_plan(build_plan(cluster, model, training, layout, est), tmp_path / "plan.json")
    steps = [{"step": s, "loss": 5.0, "step_time_s": est["step_time_s"] * (3 if s == 1 else measured_scale),
              "tokens_per_s": 1.0} for s in (1, 2, 3)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
    if with_summary:
        ranks = [{"rank": r, "model_state_bytes": {k: est["memory_bytes"][k] * 1.02 for k in
                                                   ("weights", "gradients", "optimizer")},
                  "peak_memory_bytes": 3e8, "pp": r // 4, "dp": 0, "tp": 0} for r in range(8)]
        summary = {"step_time_s": est["step_time_s"] * measured_scale, "tokens_per_s": est["tokens_per_s"] / measured_scale,
                   "precision": "fp32", "backend": "gloo", "ranks": ranks}
        (tmp_path / "summary.json").write_text(json.dumps(summary))
    return est


def by_term(report):
    return {r["term"]: r for r in report.rows}


def test_pairs_step_time_and_memory(tmp_path):
    est = make_run(tmp_path)
    rows = by_term(compare(read_run(tmp_path)))
    assert rows["step time"]["predicted"] == pytest.approx(est["step_time_s"])
    assert rows["step time"]["error"] == pytest.approx(1 / 1.1 - 1)  # predicted / measured - 1
    assert rows["weights (most-loaded rank)"]["error"] == pytest.approx(1 / 1.02 - 1)
    assert rows["communication share of step"]["measured"] is None
    assert 0 < rows["communication share of step"]["predicted"] < 1


def test_measured_phases_pair_with_the_predicted_terms_inside_them(tmp_path):
    est = make_run(tmp_path)
    phases = {"forward_backward": 0.2, "grad_reduce": 0.03, "clip": 0.01, "optimizer": 0.005, "loss": 0.005}
    steps = [{"step": s, "loss": 5.0, "step_time_s": 0.25, "tokens_per_s": 1.0,
              "phases_s": {k: v * (9 if s == 1 else 1) for k, v in phases.items()}} for s in (1, 2, 3)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
    summary = json.loads((tmp_path / "summary.json").read_text())
    (tmp_path / "summary.json").write_text(json.dumps({**summary, "warmup_steps": 1}))
    rows = by_term(compare(read_run(tmp_path)))
    fb = rows["forward + backward (compute, bubble, TP/PP comm)"]
    after = rows["after the backward (DP/ZeRO comm, clip, optimizer, loss)"]
    assert fb["measured"] == pytest.approx(0.2) and after["measured"] == pytest.approx(0.05)  # warm-up step left out
    t = est["time_s"]
    assert fb["predicted"] == pytest.approx(sum(t[k] for k in ("compute", "recompute", "bubble", "tp_comm",
                                                                  "pp_comm", "overhead")))
    assert fb["predicted"] + after["predicted"] == pytest.approx(est["step_time_s"])  # every term in one phase


def test_a_run_without_phase_timings_has_no_phase_rows(tmp_path):
    make_run(tmp_path)
    assert not any(r["term"].startswith("forward + backward") for r in compare(read_run(tmp_path)).rows)


def test_without_summary_the_first_step_is_left_out(tmp_path):
    make_run(tmp_path, measured_scale=1.25, with_summary=False)
    report = compare(read_run(tmp_path))
    assert by_term(report)["step time"]["error"] == pytest.approx(1 / 1.25 - 1)
    assert any("no summary.json" in n for n in report.notes)


def test_another_cluster_spec_changes_the_prediction(tmp_path):
    from plan3d.calibrate import scaled_compute

    est = make_run(tmp_path)
    slower = scaled_compute(load_cluster("local-cpu"), 0.5)
    assert by_term(compare(read_run(tmp_path), slower))["step time"]["predicted"] > est["step_time_s"]


def test_cli_report_json_table_and_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    make_run(tmp_path)
    with pytest.raises(SystemExit) as info:
        main(["report", str(tmp_path), "--json"])
    assert info.value.code in (0, None)
    data = json.loads(capsys.readouterr().out)
    assert data["schema_version"] == 1 and data["rows"][0]["term"] == "step time"
    picture = tmp_path / "report.png"
    with pytest.raises(SystemExit) as info:
        main(["report", str(tmp_path), "--plot", str(picture)])
    assert info.value.code in (0, None)
    assert "measured vs predicted" in capsys.readouterr().out
    assert picture.read_bytes()[:4] == b"\x89PNG"


def test_cli_report_missing_run_dir_is_exit_2(tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        main(["report", str(tmp_path / "nope")])
    assert info.value.code == 2 and "plan.json" in capsys.readouterr().err


def test_plots_write_files(tmp_path):
    pytest.importorskip("matplotlib")
    from plan3d.render.plots import pareto_front, plot_pareto, plot_step_breakdown

    points = [{"tokens_per_s": t, "peak_memory_bytes": m * 2**30, "label": f"L{i}"}
              for i, (t, m) in enumerate([(10, 1), (20, 2), (15, 3), (30, 4), (5, 0.5)])]
    assert pareto_front(points) == [4, 0, 1, 3]
    plot_pareto(points, tmp_path / "pareto.svg", capacity_bytes=3.5 * 2**30)
    assert b"<svg" in (tmp_path / "pareto.svg").read_bytes()[:500]
    est = estimate(load_cluster("local-cpu"), load_model("tiny-gpt"), TrainingSpec(global_batch=16),
                   Layout(pp=2, dp=4)).to_dict()
    plot_step_breakdown(est, tmp_path / "step.png")
    assert (tmp_path / "step.png").stat().st_size > 1000


def test_plot_rejects_an_unknown_suffix(tmp_path):
    pytest.importorskip("matplotlib")
    from plan3d.errors import Plan3dError
    from plan3d.render.plots import plot_pareto

    with pytest.raises(Plan3dError, match=".png"):
        plot_pareto([{"tokens_per_s": 1, "peak_memory_bytes": 1}], tmp_path / "x.jpg")


def test_a_bf16_plan_run_in_fp32_is_predicted_in_fp32(tmp_path):
    """A CPU launch trains in fp32 whatever the plan assumed: memory is compared like with like."""
    make_run(tmp_path)  # summary and measured bytes are fp32 (+2%)
    plan_path = tmp_path / "plan.json"
    plan = json.loads(plan_path.read_text())
    cluster, model = load_cluster("local-cpu"), load_model("tiny-gpt")
    bf16 = TrainingSpec(global_batch=16, precision="bf16")
    layout = Layout(tp=2, pp=2, dp=2)
    save_plan(build_plan(cluster, model, bf16, layout, estimate(cluster, model, bf16, layout).to_dict()), plan_path)
    assert plan["training"]["precision"] == "fp32"  # the helper wrote fp32; now the plan says bf16
    report = compare(read_run(tmp_path))
    assert by_term(report)["weights (most-loaded rank)"]["error"] == pytest.approx(1 / 1.02 - 1)
    assert any("recomputed for fp32" in n for n in report.notes)


def test_launch_ends_with_the_table_of_report_predicted_for_what_the_run_did(tmp_path, capsys, monkeypatch):
    """One renderer: the end of `plan3d launch` is `plan3d report`'s output, after the losses; a
    CPU run of a bf16 plan is predicted in fp32 in both."""
    from plan3d.cli.launch_cmd import _print_end
    from plan3d.render.report import fmt

    monkeypatch.setenv("COLUMNS", "200")
    make_run(tmp_path)
    cluster, model = load_cluster("local-cpu"), load_model("tiny-gpt")
    bf16, layout = TrainingSpec(global_batch=16, precision="bf16"), Layout(tp=2, pp=2, dp=2)
    bf16_plan = build_plan(cluster, model, bf16, layout, estimate(cluster, model, bf16, layout).to_dict())
    save_plan(bf16_plan, tmp_path / "plan.json")
    summary = json.loads((tmp_path / "summary.json").read_text())
    summary.update(losses=[5.5, 5.25, 5.125], first_step=1, steps=3)
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    with pytest.raises(SystemExit) as info:
        main(["report", str(tmp_path)])
    assert info.value.code in (0, None)
    report_out = capsys.readouterr().out
    _print_end(tmp_path)
    launch_out = capsys.readouterr().out
    assert launch_out.startswith("losses (steps 1..3): 5.5000, 5.2500, 5.1250\n") and launch_out.endswith(report_out)
    fp32 = estimate(cluster, model, bf16.model_copy(update={"precision": "fp32"}), layout).to_dict()
    assert fp32["step_time_s"] != pytest.approx(bf16_plan.estimate.step_time_s)
    assert f"step time | {fmt(fp32['step_time_s'], 's')}" in " ".join(report_out.replace("│", "|").split())


def test_launch_without_a_summary_is_one_error_naming_the_logs(tmp_path):
    from plan3d.cli.launch_cmd import _print_end
    from plan3d.errors import LaunchError

    make_run(tmp_path, with_summary=False)
    with pytest.raises(LaunchError, match="without .*summary.json; see .*logs"):
        _print_end(tmp_path)


def write_segments(tmp_path, *segments):
    (tmp_path / "segments.jsonl").write_text("".join(json.dumps(s) + "\n" for s in segments))


def two_launches(tmp_path):
    """Steps 1-2 in tp4 (killed before its target, step 4), steps 3-4 resumed in tp2 pp2 dp2."""
    make_run(tmp_path, with_summary=False)
    steps = [{"step": s, "loss": 6.0 - s, "step_time_s": t, "tokens_per_s": 100 / t,
              "phases_s": {"forward_backward": t, "grad_reduce": 0.0, "clip": 0.0, "optimizer": 0.0, "loss": 0.0}}
             for s, t in ((1, 9.0), (2, 3.0), (3, 8.0), (4, 1.0))]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
    write_segments(tmp_path,
                   {"first_step": 1, "target_step": 4, "resumed_at_step": 0, "resumed_from": None,
                    "layout": "tp4 pp1 dp2", "world_size": 8, "warmup_steps": 1, "predicted_step_time_s": 2.0},
                   {"first_step": 3, "target_step": 4, "resumed_at_step": 2, "resumed_from": "r/checkpoints/step_2",
                    "layout": "tp2 pp2 dp2", "world_size": 8, "warmup_steps": 1, "predicted_step_time_s": 1.5})


def test_a_resumed_run_is_reported_segment_by_segment(tmp_path):
    two_launches(tmp_path)
    report = compare(read_run(tmp_path))
    first, second = report.segments
    assert (first["first_step"], first["last_step"], first["ended"]) == (1, 2, "interrupted")
    assert (second["first_step"], second["last_step"], second["ended"]) == (3, 4, "completed")
    assert (first["step_time_s"], second["step_time_s"]) == (3.0, 1.0)  # each without its own warm-up step
    assert (first["train_time_s"], second["train_time_s"]) == (12.0, 9.0)
    assert second["resumed_at_step"] == 2 and second["final_loss"] == 2.0
    rows = by_term(report)
    assert rows["step time"]["measured"] == 1.0  # the last launch, whose layout plan.json holds
    assert rows["forward + backward (compute, bubble, TP/PP comm)"]["measured"] == 1.0
    assert any("2 launches" in note for note in report.notes)


def test_cli_report_prints_every_segment(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    two_launches(tmp_path)
    with pytest.raises(SystemExit) as info:
        main(["report", str(tmp_path)])
    out = capsys.readouterr().out
    assert info.value.code in (0, None)
    assert "segment 1: steps 1..2 (from the start), tp4 pp1 dp2 on 8 ranks, 3000.0 ms/step" in out
    assert "segment 2: steps 3..4 (resumed from step 2), tp2 pp2 dp2 on 8 ranks" in out and "interrupted" in out
    with pytest.raises(SystemExit) as info:
        main(["report", str(tmp_path), "--json"])
    assert [s["layout"] for s in json.loads(capsys.readouterr().out)["segments"]] == ["tp4 pp1 dp2", "tp2 pp2 dp2"]


@pytest.mark.parametrize("segment, field", [({"first_step": "1"}, "first_step"),
                                            ({"first_step": 1, "warmup_steps": -1}, "warmup_steps"),
                                            ({"first_step": 1, "predicted_step_time_s": "fast"}, "predicted_step_time_s")])
def test_a_damaged_segments_file_is_one_line_naming_the_field(tmp_path, capsys, segment, field):
    make_run(tmp_path)
    write_segments(tmp_path, segment)
    with pytest.raises(SystemExit) as info:
        main(["report", str(tmp_path)])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "segments.jsonl: segment 1" in err and field in err
    assert "Traceback" not in err


# ---- red team of issue 19: every number report reads is finite and physical ----------------------
def report_refuses(tmp_path, capsys, fragment: str) -> str:
    with pytest.raises(SystemExit) as info:
        main(["report", str(tmp_path)])
    out, err = capsys.readouterr()
    assert info.value.code == 2, (out, err)
    assert "internal error" not in err and "Traceback" not in err and "inf" not in out
    assert err.startswith("error: ") and fragment in err, err
    return err


def rewrite_metrics(tmp_path, edit):
    path = tmp_path / "metrics.jsonl"
    steps = [json.loads(line) for line in path.read_text().splitlines()]
    edit(steps)
    path.write_text("".join(json.dumps(s) + "\n" for s in steps))


@pytest.mark.parametrize("step", [None, -1, "2", 1e13])
def test_a_bad_step_number_is_one_error_line(tmp_path, capsys, step):
    make_run(tmp_path)
    write_segments(tmp_path, {"first_step": 1})
    rewrite_metrics(tmp_path, lambda steps: steps[1].update(step=step))
    report_refuses(tmp_path, capsys, "metrics.jsonl: line 2: step")


@pytest.mark.parametrize("field, value", [("step_time_s", 1e308), ("step_time_s", 1e10), ("tokens_per_s", 1e300),
                                          ("phases_s", {"forward_backward": 1.7e308})])
def test_a_summary_value_past_its_physical_bound_is_refused(tmp_path, capsys, field, value):
    make_run(tmp_path)
    summary = json.loads((tmp_path / "summary.json").read_text())
    (tmp_path / "summary.json").write_text(json.dumps({**summary, field: value}))
    report_refuses(tmp_path, capsys, f"summary.json: {field}")


def test_a_summary_rank_with_exabytes_is_refused(tmp_path, capsys):
    make_run(tmp_path)
    summary = json.loads((tmp_path / "summary.json").read_text())
    summary["ranks"][3]["peak_memory_bytes"] = 1.7e308
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    report_refuses(tmp_path, capsys, "ranks.3.peak_memory_bytes")


@pytest.mark.parametrize("edit", [lambda s: s.update(step_time_s=1.7e308),
                                  lambda s: s.update(phases_s={"forward_backward": 1.7e308})])
def test_metrics_past_their_physical_bound_are_refused(tmp_path, capsys, edit):
    make_run(tmp_path, with_summary=False)
    rewrite_metrics(tmp_path, lambda steps: [edit(s) for s in steps])
    report_refuses(tmp_path, capsys, "metrics.jsonl: line 1")


@pytest.mark.parametrize("key, path", [("step_time_s", ()), ("time_s", ("compute",)), ("memory_bytes", ("weights",)),
                                       ("tokens_per_s", ())])
def test_a_plan_estimate_past_its_bounds_is_refused_even_with_its_digest_recomputed(tmp_path, capsys, key, path):
    from plan3d.plan import content_digest

    make_run(tmp_path)
    data = json.loads((tmp_path / "plan.json").read_text())
    target = data["estimate"]
    for part in (key, *path)[:-1]:
        target = target[part]
    target[(key, *path)[-1]] = 1e308
    data["digest"] = content_digest(data)
    (tmp_path / "plan.json").write_text(json.dumps(data))
    report_refuses(tmp_path, capsys, f"estimate.{'.'.join((key, *path))}")


def test_a_measurement_near_zero_gives_no_infinite_prediction_error():
    from plan3d.run.compare import prediction_error, row

    assert prediction_error(1e9, 5e-324) is None and row("step time", 1e9, 5e-324, "s")["error"] is None
    assert prediction_error(1.1, 1.0) == pytest.approx(0.1)
