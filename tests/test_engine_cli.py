"""`--engine` on estimate / explain / recommend / check, `engine:` in job files and plans, engines in
the catalog, and the runtime's own engine for launch's comparisons (issue 14)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from plan3d.cost.estimate import estimate
from plan3d.layout import Layout
from plan3d.plan import DIGESTED, build_plan, digest_of, load_plan, save_plan
from plan3d.specs.catalog import DEFAULT_ENGINE, RUNTIME_ENGINE, bundled_dir, bundled_names, load_cluster, \
    load_engine, load_model
from plan3d.specs.training import TrainingSpec
from cli_helpers import run_cli  # noqa: E402

GPT3 = ["-c", "dgx-a100-80g", "-m", "gpt3-175b"]
SEED = ["--tp", "8", "--pp", "8", "--dp", "8"]
SMALL = ["--cluster", "dgx-a100-80g", "--model", "llama3-8b", "--nodes", "2", "--global-batch", "64"]
CPU = ["--cluster", "local-cpu", "--model", "tiny-gpt", "--global-batch", "16"]


def ok_json(capsys, *args) -> dict:
    code, out, err = run_cli(capsys, *args, "--json")
    assert code == 0, err
    return json.loads(out)


def one_error_line(capsys, *args) -> str:
    code, out, err = run_cli(capsys, *args)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    return lines[0]


# ---- refusing what the engine cannot run -------------------------------------------------------
def test_estimate_refuses_a_layout_the_engine_cannot_run(capsys):
    line = one_error_line(capsys, "estimate", *GPT3, *SEED, "--zero", "1", "--engine", "megatron-lm-2021")
    assert "megatron-lm-2021 cannot run ZeRO-1 with pipeline parallelism" in line
    line = one_error_line(capsys, "estimate", *GPT3, *SEED, "--engine", "deepspeed")
    assert "deepspeed has no tensor parallelism" in line
    line = one_error_line(capsys, "estimate", *GPT3, *SEED, "--zero", "1", "--engine", "torchtitan")
    assert "torchtitan cannot run ZeRO-1" in line
    assert ok_json(capsys, "estimate", *GPT3, *SEED, "--zero", "1", "--engine", "megatron-core")["fits"]


@pytest.mark.parametrize("command", ["estimate", "recommend"])
def test_a_model_the_engine_cannot_build_is_refused_before_planning(capsys, command):
    """The profile's can_run.models, read by the search and the estimate as by the emitter."""
    knobs = SEED if command == "estimate" else ["--top", "1"]
    line = one_error_line(capsys, command, *GPT3, *knobs, "--engine", "torchtitan")
    assert "torchtitan cannot build gpt3-175b: activation gelu (it has swiglu)" in line and "emit megatron" in line
    line = one_error_line(capsys, command, "-c", "dgx-a100-80g", "-m", "bloom-176b", *knobs, "--engine",
                          "megatron-core")
    assert "megatron-core cannot build bloom-176b: position alibi (it has learned, rope)" in line


def test_the_default_engine_is_one_that_builds_the_model(capsys):
    assert ok_json(capsys, "recommend", *GPT3, "--top", "1")["engine"] == DEFAULT_ENGINE
    bloom = ok_json(capsys, "recommend", "-c", "dgx-a100-80g", "-m", "bloom-176b", "--top", "1")
    assert bloom["engine"] == "megatron-deepspeed" and bloom["top"]  # BLOOM's ALiBi: its own engine


def test_explain_refuses_a_layout_the_engine_cannot_run(capsys):
    line = one_error_line(capsys, "explain", *SMALL, "--tp", "2", "--pp", "2", "--vpp", "2",
                          "--engine", "megatron-deepspeed")
    assert "megatron-deepspeed has no interleaved-1f1b pipeline schedule; it runs 1f1b: use vpp=1" in line


@pytest.mark.parametrize("command", [["estimate", *GPT3, *SEED], ["explain", *GPT3, *SEED],
                                     ["recommend", *SMALL], ["check", "examples/jobs/gpt3-175b-seed.yaml"]])
def test_an_unknown_engine_is_one_line_with_a_hint(capsys, command):
    line = one_error_line(capsys, *command, "--engine", "megatron-cor")
    assert "unknown engine 'megatron-cor'" in line and "did you mean 'megatron-core'" in line


# ---- every output names the engine ------------------------------------------------------------
def test_estimate_json_names_the_engine_and_its_default_by_cluster(capsys):
    core = ok_json(capsys, "estimate", *GPT3, *SEED)
    assert core["engine"] == DEFAULT_ENGINE and core["provenance"]
    llama = ["-c", "dgx-a100-80g", "-m", "llama3-70b"]  # torchtitan 0.3 builds Llama-shaped models only
    titan = ok_json(capsys, "estimate", *llama, *SEED, "--sequence-parallel", "--engine", "torchtitan")
    assert titan["engine"] == "torchtitan"
    sp_core = ok_json(capsys, "estimate", *llama, *SEED, "--sequence-parallel")
    assert titan["step_time_s"] != pytest.approx(sp_core["step_time_s"], rel=1e-6)  # the engine changes the time
    assert ok_json(capsys, "estimate", *CPU, "--dp", "8")["engine"] == RUNTIME_ENGINE


def test_estimate_table_prints_the_engine_provenance_and_warnings(capsys):
    code, out, _ = run_cli(capsys, "estimate", "-c", "dgx-h100", "-m", "gpt3-175b", *SEED, "--precision", "fp8",
                           "--engine", "megatron-deepspeed")  # fp8 needs an FP8 GPU (the A100 refuses it)
    assert code == 0
    spec = load_engine("megatron-deepspeed")
    flat = " ".join(out.split())  # rich wraps long lines
    assert f"engine: megatron-deepspeed ({spec.description})" in flat
    est = estimate(load_cluster("dgx-h100"), load_model("gpt3-175b"),
                   TrainingSpec(global_batch=1536, precision="fp8"), Layout(tp=8, pp=8, dp=8), spec)
    assert est.provenance and est.warnings  # fp8 is never calibrated
    for line in est.provenance:
        assert f"provenance: {line}" in flat
    for warning in est.warnings:
        assert f"warning: {warning}" in flat


def test_an_engine_file_is_accepted_by_path(capsys, tmp_path):
    data = yaml.safe_load((bundled_dir("engine") / "megatron-core.yaml").read_text())
    data["name"] = "my-engine"
    path = tmp_path / "my-engine.yaml"
    path.write_text(yaml.safe_dump(data))
    assert ok_json(capsys, "estimate", *GPT3, *SEED, "--engine", path)["engine"] == "my-engine"


def test_recommend_and_explain_name_the_engine(capsys):
    data = ok_json(capsys, "recommend", *SMALL, "--top", "2", "--explain", "--engine", "torchtitan")
    assert data["engine"] == "torchtitan" and data["explain"]["engine"] == "torchtitan"
    explained = ok_json(capsys, "explain", *SMALL, "--tp", "2", "--engine", "megatron-deepspeed")
    assert explained["engine"] == "megatron-deepspeed"
    assert any("megatron-deepspeed" in line for line in explained["provenance"])
    code, out, _ = run_cli(capsys, "recommend", *SMALL, "--top", "2", "--engine", "torchtitan")
    assert code == 0 and out.startswith("engine: torchtitan (")
    code, out, _ = run_cli(capsys, "explain", *SMALL, "--tp", "2")
    assert code == 0 and out.startswith(f"engine: {DEFAULT_ENGINE} (") and "provenance:" in out


# ---- job files ------------------------------------------------------------------------------
JOB = """cluster: dgx-a100-80g
nodes: 64
model: gpt3-175b
training: {global_batch: 1536}
layout: {tp: 8, pp: 8, dp: 8, micro_batch: 1, zero: 1, recompute: selective, sequence_parallel: true}
"""


def check_json(capsys, path, *args) -> tuple[int, dict]:
    code, out, err = run_cli(capsys, "check", path, "--json", *args)
    assert code in (0, 1), err
    return code, json.loads(out)


def test_job_engine_is_checked_and_check_engine_overrides_it(capsys, tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text(JOB + "engine: megatron-lm-2021\n")
    code, data = check_json(capsys, job)
    assert code == 1 and data["engine"] == "megatron-lm-2021" and not data["ok"]
    assert any("megatron-lm-2021 cannot run ZeRO-1" in f["message"] for f in data["findings"])
    assert data["recommended"]["layout"]["zero"] == 0  # what that engine can run
    code, data = check_json(capsys, job, "--engine", "megatron-core")
    assert code == 0 and data["engine"] == "megatron-core" and data["ok"]
    code, out, _ = run_cli(capsys, "check", job)
    assert code == 1 and "engine: megatron-lm-2021 (" in out


def test_job_without_engine_gets_the_default(capsys, tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text(JOB)
    code, data = check_json(capsys, job)
    assert code == 0 and data["engine"] == DEFAULT_ENGINE


def test_job_engine_as_a_relative_path_or_an_inline_mapping(capsys, tmp_path):
    (tmp_path / "engines").mkdir()
    shutil.copy(bundled_dir("engine") / "deepspeed.yaml", tmp_path / "engines" / "ds.yaml")
    job = tmp_path / "job.yaml"
    job.write_text(JOB + "engine: engines/ds.yaml\n")
    code, data = check_json(capsys, job)
    assert code == 1 and data["engine"] == "deepspeed"
    assert any("tensor parallelism" in f["message"] for f in data["findings"])
    inline = {"name": "inline-engine", "can_run": {"zero": [0, 1], "zero_with_pp": [0, 1]}}
    job.write_text(JOB + "engine: " + json.dumps(inline) + "\n")
    code, data = check_json(capsys, job)
    assert code == 0 and data["engine"] == "inline-engine"


def test_a_bad_inline_engine_is_a_job_file_error(capsys, tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text(JOB + "engine: {name: x, can_run: {zero: [5]}}\n")
    code, _, err = run_cli(capsys, "check", job)
    assert code == 2 and "engine" in err and "Traceback" not in err


# ---- plans ------------------------------------------------------------------------------------
def test_plan_json_round_trips_the_engine(capsys, tmp_path):
    path = tmp_path / "plan.json"
    data = ok_json(capsys, "recommend", *SMALL, "--engine", "torchtitan", "--out", path)
    plan = load_plan(str(path))
    assert plan.engine == load_engine("torchtitan")
    assert plan.estimate.engine == "torchtitan"
    assert plan.estimate.tokens_per_s == pytest.approx(data["top"][0]["tokens_per_s"], rel=1e-9)
    assert plan.digest == plan.specs_digest() != digest_of({k: getattr(plan, k).model_dump(mode="json")
                                                            for k in DIGESTED})
    raw = json.loads(path.read_text())
    raw["engine"]["can_run"]["zero"] = [0]  # the digest covers the engine
    path.write_text(json.dumps(raw))
    code, _, err = run_cli(capsys, "launch", path, "--dry-run")
    assert code == 2 and "digest" in err


def old_plan(path: Path) -> dict:
    """A plan as plan3d wrote it before engines: no `engine` section, digest over four sections."""
    cluster, model = load_cluster("local-cpu"), load_model("tiny-gpt")
    training, layout = TrainingSpec(global_batch=16, precision="fp32"), Layout(tp=2, pp=2, dp=2)
    plan = build_plan(cluster, model, training, layout, estimate(cluster, model, training, layout).to_dict())
    data = json.loads(plan.model_dump_json())
    del data["engine"]
    for key in ("engine", "provenance"):
        data["estimate"].pop(key, None)
    data["digest"] = digest_of({k: data[k] for k in DIGESTED})  # the digest of that time: the four sections
    path.write_text(json.dumps(data))
    return data


def test_an_older_plan_without_engine_loads_and_launches_dry_run(capsys, tmp_path):
    data = old_plan(tmp_path / "plan.json")
    plan = load_plan(str(tmp_path / "plan.json"))
    assert plan.engine is None and plan.digest == digest_of({k: data[k] for k in DIGESTED})
    code, out, err = run_cli(capsys, "launch", tmp_path / "plan.json", "--dry-run", "--run-dir", tmp_path / "run")
    assert code == 0, err
    assert "torch.distributed.run" in out and "made for" not in out


def test_launch_predicts_for_the_runtime_and_says_so(capsys, tmp_path):
    from plan3d.run.compare import engine_note, predicted_for_run as estimate_as_run

    path = tmp_path / "plan.json"
    ok_json(capsys, "recommend", *CPU, "--engine", "megatron-core", "--out", path)
    plan = load_plan(str(path))
    assert plan.engine.name == "megatron-core"
    as_run = estimate_as_run(plan, plan.training.precision)
    runtime = estimate(plan.cluster, plan.model, plan.training, plan.layout, load_engine(RUNTIME_ENGINE))
    assert as_run.engine == RUNTIME_ENGINE and as_run.step_time_s == pytest.approx(runtime.step_time_s)
    assert as_run.step_time_s != pytest.approx(plan.estimate.step_time_s, rel=1e-6)
    assert "megatron-core" in engine_note(plan) and RUNTIME_ENGINE in engine_note(plan)
    code, out, err = run_cli(capsys, "launch", path, "--dry-run", "--run-dir", tmp_path / "run")
    assert code == 0, err
    assert "# the plan was made for megatron-core" in out


def test_a_runtime_plan_keeps_its_stored_estimate(tmp_path):
    from plan3d.run.compare import engine_note, predicted_for_run as estimate_as_run

    cluster, model = load_cluster("local-cpu"), load_model("tiny-gpt")
    training, layout = TrainingSpec(global_batch=16, precision="fp32"), Layout(dp=8)
    engine = load_engine(RUNTIME_ENGINE)
    plan = build_plan(cluster, model, training, layout, estimate(cluster, model, training, layout, engine).to_dict(),
                      engine)
    assert estimate_as_run(plan, "fp32") is plan.estimate and engine_note(plan) is None


def test_report_notes_the_engine_the_plan_was_made_for(tmp_path):
    from plan3d.run.compare import compare
    from plan3d.run.record import read_run

    cluster, model = load_cluster("local-cpu"), load_model("tiny-gpt")
    training, layout = TrainingSpec(global_batch=16, precision="fp32"), Layout(dp=8)
    engine = load_engine("megatron-core")
    est = estimate(cluster, model, training, layout, engine).to_dict()
    save_plan(build_plan(cluster, model, training, layout, est, engine), tmp_path / "plan.json")
    (tmp_path / "summary.json").write_text(json.dumps({"step_time_s": 0.5, "ranks": [], "precision": "fp32"}))
    report = compare(read_run(tmp_path))
    runtime = estimate(cluster, model, training, layout, load_engine(RUNTIME_ENGINE))
    assert report.rows[0]["predicted"] == pytest.approx(runtime.step_time_s)
    assert any("made for megatron-core" in note for note in report.notes)


# ---- catalog -----------------------------------------------------------------------------------
def test_specs_list_show_and_schema_include_engines(capsys):
    rows = ok_json(capsys, "specs", "list")
    assert {r["name"] for r in rows if r["kind"] == "engine"} == set(bundled_names("engine")) >= {
        "megatron-core", "megatron-deepspeed", "torchtitan", "deepspeed", "plan3d-runtime"}
    shown = ok_json(capsys, "specs", "show", "megatron-deepspeed")
    assert shown["can_run"]["zero_with_pp"] == [0, 1]
    assert ok_json(capsys, "specs", "show", "torchtitan", "--kind", "engine")["name"] == "torchtitan"
    code, out, _ = run_cli(capsys, "specs", "schema", "engine")
    assert code == 0 and "can_run" in json.loads(out)["properties"]
    code, out, _ = run_cli(capsys, "specs", "list")
    assert code == 0 and "megatron-deepspeed" in out


# ---- calibration says it calibrated ---------------------------------------------------------
def test_calibrate_stamps_fitted_on_and_provenance_reports_it():
    from plan3d.calibrate import calibrated_cluster, collective_terms, fit_measurements, stamped
    from plan3d.cost.trust import provenance

    base = load_cluster("local-cpu")
    peak = base.gpu.peak_flops("fp32")
    gemm = [{"flops": w, "time_s": w / (peak * 0.5 * w / (w + 1e6))} for w in (1e5, 1e6, 1e7, 1e8, 1e9)]
    collectives = []
    for n in (2, 4, 8):
        for size in (4096, 1 << 20):
            volume, hops = collective_terms("all_reduce", n, size)
            collectives.append({"op": "all_reduce", "group_size": n, "bytes": size, "time_s": volume / 1e9 + hops * 1e-4,
                                "tier": 0})
    raw = {"device": "cpu", "backend": "gloo", "world_size": 8, "gemm": gemm, "collectives": collectives}
    data = base.model_dump()
    data["gpu"]["compute_efficiency"]["fitted_on"] = ""  # as if never calibrated
    base = type(base).model_validate(data)
    fitted = calibrated_cluster(base, fit_measurements(base, raw, "fp32"), "test")
    assert fitted.gpu.compute_efficiency.fitted_on.startswith("plan3d calibrate, 20")
    training = TrainingSpec(global_batch=16)
    assert "fitted on plan3d calibrate" in provenance(fitted, None, training).lines[0]
    assert "fitted on plan3d calibrate" not in provenance(base, None, training).lines[0]
    assert stamped(base, "plan3d calibrate --from-run").gpu.compute_efficiency.fitted_on.startswith(
        "plan3d calibrate --from-run, 20")
