"""Tampered spec, job and plan files: every bad file is one `error:` line naming the file and
the field, exit 2; never an internal error, a traceback or a silent YAML 1.1 reading."""
from __future__ import annotations

import json
import time

import pytest
import yaml

from cli_helpers import run_cli
from plan3d.layout import Layout
from plan3d.plan import build_plan, content_digest, save_plan
from plan3d.specs.catalog import load_cluster, load_model
from plan3d.specs.training import TrainingSpec

CLUSTER = {"name": "mine", "nodes": 2, "gpus_per_node": 8, "gpu": "h100-sxm",
           "network": [{"name": "nvlink", "bandwidth": {"gbytes_per_s_per_gpu": 450}, "latency_us": 3},
                       {"name": "ib", "bandwidth": {"gbytes_per_s_per_gpu": 50}, "latency_us": 8}]}
MODEL_YAML = "name: m\nlayers: 32\nhidden: 1024\nheads: 16\nvocab: 32000\nseq_len: 2048\n"


def refused(capsys, *args, fragment: str = "") -> str:
    """Run plan3d; assert exit 2 with `error:` lines, one per problem, one holding `fragment`; return it."""
    code, out, err = run_cli(capsys, *args)
    lines = err.strip().splitlines()
    assert code == 2 and lines and all(line.startswith("error: ") for line in lines), (code, out, err)
    assert "internal error" not in err and "Traceback" not in err
    matching = [line for line in lines if fragment in line]
    assert matching, (fragment, lines)
    return matching[0]


def show_model(capsys, tmp_path, text: str, fragment: str) -> str:
    path = tmp_path / "model.yaml"
    path.write_text(text)
    line = refused(capsys, "specs", "show", path, "--kind", "model", fragment=fragment)
    assert str(path) in line
    return line


# ---- YAML 1.1 surprises, read as YAML 1.2 or refused ---------------------------------------------
@pytest.mark.parametrize("value, fragment", [
    ("040", "line 2: 040 has a leading zero"),           # YAML 1.1: octal 32
    ("1:30", "layers: Input should be a valid integer, got '1:30'"),  # YAML 1.1: sexagesimal 90
    ("true", "layers: Input should be a valid integer, got True"),     # lax: 1
    ('"32"', "layers: Input should be a valid integer, got '32'"),     # lax: 32
    ("1_000", "got '1_000'"),                                          # YAML 1.1: 1000
    ("32.5", "layers: Input should be a valid integer, got 32.5"),
])
def test_yaml_1_1_integers_are_not_guessed(capsys, tmp_path, value, fragment):
    show_model(capsys, tmp_path, MODEL_YAML.replace("layers: 32", f"layers: {value}"), fragment)


def test_yaml_1_1_booleans_are_strings(capsys, tmp_path):
    show_model(capsys, tmp_path, MODEL_YAML + "bias: yes\n", "bias: Input should be a valid boolean, got 'yes'")


def test_a_duplicate_key_is_refused_not_silently_the_last(capsys, tmp_path):
    line = show_model(capsys, tmp_path, MODEL_YAML + "layers: 48\n", "key 'layers' is given twice")
    assert "line 7" in line
    path = tmp_path / "model.json"
    path.write_text('{"name": "m", "layers": 32, "layers": 48}')
    refused(capsys, "specs", "show", path, "--kind", "model", fragment="key 'layers' is given twice")


def test_a_merge_key_is_not_a_duplicate(capsys, tmp_path):
    path = tmp_path / "model.yaml"
    path.write_text("base: &b {hidden: 1024, heads: 16}\n" + MODEL_YAML)  # an anchor alone is an unknown field
    refused(capsys, "specs", "show", path, "--kind", "model", fragment="base: unknown field")
    text = "name: m\n<<: {layers: 32, hidden: 1024, heads: 16}\nhidden: 2048\nvocab: 32000\nseq_len: 2048\n"
    path.write_text(text)
    code, out, err = run_cli(capsys, "specs", "show", path, "--kind", "model", "--json")
    assert code == 0, err
    assert json.loads(out)["hidden"] == 2048  # the mapping's own key wins over the merged one


def test_a_string_for_a_count_in_a_job_is_refused(capsys, tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text('cluster: dgx-h100\nnodes: "2"\nmodel: llama3-8b\ntraining: {global_batch: 64}\n')
    refused(capsys, "check", job, fragment="nodes")


def test_json_nan_is_refused(capsys, tmp_path):
    path = tmp_path / "model.json"
    path.write_text('{"name": "m", "layers": NaN}')
    refused(capsys, "specs", "show", path, "--kind", "model", fragment="NaN is not a number")


# ---- structures that used to crash the loader ---------------------------------------------------
@pytest.mark.parametrize("suffix, text", [
    (".yaml", "name: x\nlayers: " + "[" * 3000 + "]" * 3000 + "\n"),
    (".json", '{"name": ' + "[" * 5000 + "]" * 5000 + "}"),
    (".json", '{"name": ' + "[" * 100 + "]" * 100 + "}"),  # parses, then too deep
])
def test_deep_nesting_is_one_line(capsys, tmp_path, suffix, text):
    path = tmp_path / f"model{suffix}"
    path.write_text(text)
    refused(capsys, "specs", "show", path, "--kind", "model", fragment="nested")


def test_yaml_aliases_cannot_expand_without_bound(capsys, tmp_path):
    lines = ["a0: &a0 [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]"]
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, 9)]
    path = tmp_path / "model.yaml"
    path.write_text("\n".join(lines) + "\n")
    start = time.perf_counter()
    refused(capsys, "specs", "show", path, "--kind", "model", fragment="values")
    assert time.perf_counter() - start < 10


def test_binary_and_timestamps_are_not_json_data(capsys, tmp_path):
    show_model(capsys, tmp_path, MODEL_YAML.replace("name: m", "name: !!binary aGVsbG8="), "name: a bytes value")
    path = tmp_path / "dated.yaml"
    path.write_text(MODEL_YAML.replace("name: m", "name: 2024-01-01"))  # YAML 1.1: a date
    code, out, err = run_cli(capsys, "specs", "show", path, "--kind", "model")
    assert code == 0 and "2024-01-01" in out, err


# ---- physical bounds ----------------------------------------------------------------------------
def cluster_file(tmp_path, **changes) -> str:
    data = json.loads(json.dumps(CLUSTER))
    for dotted, value in changes.items():
        *parents, last = dotted.split("__")
        target = data
        for part in parents:
            target = target[int(part)] if part.isdigit() else target[part]
        target[last] = value
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


@pytest.mark.parametrize("changes, fragment", [
    ({"gpu": {"name": "g", "memory_gib": 80, "peak_tflops": {"fp8": 100}, "hbm_tbytes_per_s": 3}},
     "gpu.peak_tflops: give the peak of at least one of bf16"),
    ({"network__0__latency_us": 1e308}, "network.0.latency_us: Input should be less than or equal to"),
    ({"network__1__bandwidth": {"gbytes_per_s_per_gpu": 1e-300}}, "network.1.bandwidth.gbytes_per_s_per_gpu"),
    ({"network__0__efficiency": 1e-300}, "network.0.efficiency: Input should be greater than or equal to"),
    ({"gpu": {"name": "g", "memory_gib": 80, "peak_tflops": {"bf16": 1e-300}, "hbm_tbytes_per_s": 3}},
     "gpu.peak_tflops.bf16"),
    ({"network__1__domain_gpus": 12}, "network.1.domain_gpus: tier 'ib' connects 12 GPUs, which is not a multiple of the 8"),
])
def test_unphysical_clusters_are_refused_before_any_arithmetic(capsys, tmp_path, changes, fragment):
    refused(capsys, "estimate", "-c", cluster_file(tmp_path, **changes), "-m", "tiny-gpt", "--global-batch", "16",
            fragment=fragment)


def test_a_node_count_at_the_bound_gives_no_pydantic_error(capsys, tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text("cluster: dgx-a100-80g\nnodes: 1000000\nmodel: gpt3-175b\ntraining: {global_batch: 1536}\n"
                   "layout: {tp: 8, pp: 8, dp: 8}\n")
    code, out, err = run_cli(capsys, "check", job)
    assert code in (1, 2) and "internal error" not in err and "Traceback" not in err, err


# ---- tampered plans -----------------------------------------------------------------------------
@pytest.fixture
def plan_path(tmp_path):
    cluster, model = load_cluster("local-cpu"), load_model("tiny-gpt")
    training, layout = TrainingSpec(global_batch=16, precision="fp32"), Layout(tp=2, pp=2, dp=2)
    from plan3d.cost.estimate import estimate

    path = tmp_path / "plan.json"
    save_plan(build_plan(cluster, model, training, layout, estimate(cluster, model, training, layout).to_dict()), path)
    return path


def tamper(path, edit, redigest: bool = True) -> None:
    data = json.loads(path.read_text())
    edit(data)
    if redigest:
        data["digest"] = content_digest(data)
    path.write_text(json.dumps(data))


def test_an_untouched_plan_launches_dry_run(capsys, plan_path):
    code, _, err = run_cli(capsys, "launch", plan_path, "--dry-run", "--run-dir", plan_path.parent / "run")
    assert code == 0, err


@pytest.mark.parametrize("edit, fragment", [
    (lambda d: d.update(digest=""), "digest: missing or empty"),
    (lambda d: d.pop("digest"), "digest: missing or empty"),
])
def test_a_plan_without_digest_is_refused(capsys, plan_path, edit, fragment):
    tamper(plan_path, edit, redigest=False)
    refused(capsys, "launch", plan_path, "--dry-run", fragment=fragment)


def test_an_edit_of_the_rank_map_breaks_the_digest(capsys, plan_path):
    tamper(plan_path, lambda d: d["rankmap"].update(gpus_per_node=4), redigest=False)
    refused(capsys, "launch", plan_path, "--dry-run", fragment="digest does not match")


@pytest.mark.parametrize("edit, fragment", [
    (lambda d: d["rankmap"].update(gpus_per_node=0), "rankmap.gpus_per_node: differs"),
    (lambda d: d["rankmap"].update(gpus_per_node="8"), "rankmap.gpus_per_node: differs"),
    (lambda d: d["rankmap"]["ranks"].reverse(), "rankmap.ranks: differs"),
    (lambda d: d["cluster"].update(nodes=4, gpus_per_node=1), "layout: tp*pp*dp*cp = 8 exceeds the cluster's 4 GPUs"),
    (lambda d: d["layout"].update(tp=3), "layout: tp=3 does not divide"),
    (lambda d: d["estimate"].update(step_time_s=-1.0), "estimate.step_time_s: Input should be greater than or equal to 0"),
    (lambda d: d["estimate"]["memory_bytes"].update(weights="1e9"), "estimate.memory_bytes.weights"),
    (lambda d: d["estimate"].pop("time_s"), "estimate.time_s: Field required"),
    (lambda d: d["layout"].update(zero=True), "zero"),
])
def test_a_re_digested_plan_is_re_checked_whole(capsys, plan_path, edit, fragment):
    tamper(plan_path, edit)
    line = refused(capsys, "launch", plan_path, "--dry-run", fragment=fragment)
    assert str(plan_path) in line and "plan3d recommend" in line


def test_a_re_digested_plan_with_an_impossible_layout_is_not_emitted(capsys, plan_path, tmp_path):
    tamper(plan_path, lambda d: d["layout"].update(tp=3))
    refused(capsys, "emit", "megatron", plan_path, "--output", tmp_path / "args.sh", fragment="tp=3 does not divide")


# ---- run directories ----------------------------------------------------------------------------
def run_dir(plan_path, summary: dict | None = None, metrics: list | None = None):
    folder = plan_path.parent
    if summary is not None:
        (folder / "summary.json").write_text(json.dumps(summary))
    steps = metrics if metrics is not None else [{"step": 1, "step_time_s": 0.1}, {"step": 2, "step_time_s": 0.1}]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
    return folder


def test_a_good_run_directory_reports(capsys, plan_path):
    code, out, err = run_cli(capsys, "report", run_dir(plan_path, {"step_time_s": 0.1, "ranks": []}), "--json")
    assert code == 0, err
    assert json.loads(out)["rows"][0]["measured"] == pytest.approx(0.1)


@pytest.mark.parametrize("summary, fragment", [
    ({"step_time_s": "0.1"}, "summary.json: step_time_s: Input should be a valid number"),
    ({"step_time_s": [0.1]}, "summary.json: step_time_s"),
    ({"step_time_s": None}, "summary.json: step_time_s"),
    ({"step_time_s": -0.1}, "summary.json: step_time_s: Input should be greater than or equal to 0"),
    ({"step_time_s": 0.1, "ranks": [{"peak_memory_bytes": -5}]}, "ranks.0.peak_memory_bytes"),
    ({"step_time_s": 0.1, "ranks": ["x"]}, "ranks.0"),
    ({"step_time_s": 0.1, "ranks": [{"model_state_bytes": [1, 2]}]}, "ranks.0.model_state_bytes"),
    ({"step_time_s": 0.1, "warmup_steps": "1"}, "warmup_steps"),
    ({"step_time_s": 0.1, "precision": 16}, "precision"),
])
def test_bad_summary_values_name_the_field(capsys, plan_path, summary, fragment):
    refused(capsys, "report", run_dir(plan_path, summary), fragment=fragment)


@pytest.mark.parametrize("metrics, fragment", [
    ([{"step": 1, "step_time_s": "fast"}, {"step": 2, "step_time_s": 0.1}], "metrics.jsonl: line 1: step_time_s"),
    ([{"step": 1, "step_time_s": 0.1, "phases_s": {"forward_backward": None}}], "phases_s.forward_backward"),
    ([{"step": 1, "step_time_s": 0.1, "phases_s": [1]}], "phases_s"),
])
def test_bad_metrics_values_name_the_line_and_field(capsys, plan_path, metrics, fragment):
    refused(capsys, "report", run_dir(plan_path, metrics=metrics), fragment=fragment)


def test_a_negative_estimate_is_never_printed(capsys, plan_path):
    tamper(plan_path, lambda d: d["estimate"]["memory_bytes"].update(weights=-1e9))
    refused(capsys, "report", run_dir(plan_path, {"step_time_s": 0.1}), fragment="estimate.memory_bytes.weights")
