"""Names that would inject output lines, error lines printed raw, special files that hang a
reader, writes that replace a special file.

Every case is refused at the boundary with one `error:` line (exit 2); no output line a name or a
path produced may start a line of its own (a GitHub `::error::` workflow command, a shell line in
an sbatch script)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml

from cli_helpers import run_cli
from plan3d.layout import Layout
from plan3d.plan import build_plan, content_digest, save_plan
from plan3d.specs.catalog import load_cluster, load_model
from plan3d.specs.training import TrainingSpec

MODEL = {"name": "m", "layers": 4, "hidden": 256, "heads": 4, "vocab": 1000, "seq_len": 128,
         "default_global_batch": 16}
GPU = {"name": "g", "memory_gib": 80, "peak_tflops": {"bf16": 989}, "hbm_tbytes_per_s": 3.35}
CLUSTER = {"name": "c", "nodes": 1, "gpus_per_node": 8, "gpu": GPU,
           "network": [{"name": "nvlink", "bandwidth": {"gbytes_per_s_per_gpu": 450}, "latency_us": 3}]}
ENGINE = {"name": "e"}
HOSTILE_NAMES = ["tiny\nrm -rf $HOME #", "::error::pwned", "x\r::error::y", "red\x1b[31m", "a\u2028b",
                 "zero\u200bwidth", "", " leading", "trailing ", "x" * 201]
ORDINARY_NAMES = ["llama3-8b", "Llama 3.1 (8B)", "modèle-7b", "Qwen2.5_7B", "2024-01-01"]


def with_name(kind: str, name: str) -> tuple[dict, str]:
    """A spec of `kind` whose name (or whose nested GPU's / network tier's name) is `name`."""
    if kind == "model":
        return {**MODEL, "name": name}, "model"
    if kind == "engine":
        return {**ENGINE, "name": name}, "engine"
    cluster = json.loads(json.dumps(CLUSTER))
    if kind == "cluster":
        cluster["name"] = name
    elif kind == "gpu":
        cluster["gpu"]["name"] = name
    else:
        cluster["network"][0]["name"] = name
    return cluster, "cluster"


def assert_one_line_errors(code: int, out: str, err: str, fragment: str = "") -> list[str]:
    lines = err.strip().splitlines()
    assert code == 2 and lines, (code, out, err)
    assert all(line.startswith("error: ") for line in lines), err
    assert "internal error" not in err and "Traceback" not in err
    assert not any(line.lstrip().startswith("::") for line in (out + err).splitlines()), (out, err)
    assert any(fragment in line for line in lines), (fragment, lines)
    return lines


# ---- A: every spec name is one line of printable text --------------------------------------------
@pytest.mark.parametrize("kind", ["model", "gpu", "cluster", "tier", "engine"])
@pytest.mark.parametrize("name", HOSTILE_NAMES)
def test_a_name_that_would_inject_a_line_is_refused(capsys, tmp_path, kind, name):
    data, spec_kind = with_name(kind, name)
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(data))
    lines = assert_one_line_errors(*run_cli(capsys, "specs", "show", path, "--kind", spec_kind), fragment="name")
    assert len(lines) == 1 and str(path) in lines[0]


@pytest.mark.parametrize("kind", ["model", "gpu", "cluster", "tier", "engine"])
@pytest.mark.parametrize("name", ORDINARY_NAMES)
def test_ordinary_names_stay_valid(capsys, tmp_path, kind, name):
    data, spec_kind = with_name(kind, name)
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(data, allow_unicode=True))
    code, out, err = run_cli(capsys, "specs", "show", path, "--kind", spec_kind, "--json")
    assert code == 0, err


def test_free_text_of_a_spec_is_one_line_too(capsys, tmp_path):
    path = tmp_path / "model.json"
    path.write_text(json.dumps({**MODEL, "source": "paper\n::error::x"}))
    assert_one_line_errors(*run_cli(capsys, "specs", "show", path, "--kind", "model"), fragment="source")


@pytest.mark.parametrize("command", [["estimate", "--tp", "1"], ["recommend"]])
def test_estimate_and_recommend_refuse_a_model_named_as_a_workflow_command(capsys, tmp_path, command):
    path = tmp_path / "model.yaml"
    path.write_text(yaml.safe_dump({**MODEL, "name": "::error::pwned"}))
    assert_one_line_errors(*run_cli(capsys, *command, "-c", "dgx-h100", "-m", path), fragment="name: the name")


def test_a_plan_whose_model_name_holds_a_newline_is_refused_before_the_sbatch_script(capsys, tmp_path):
    plan = build_plan(load_cluster("local-cpu"), load_model("tiny-gpt"), TrainingSpec(global_batch=16),
                      Layout(tp=2, pp=2, dp=2))
    data = json.loads(plan.model_dump_json())
    data["model"]["name"] = "tiny\nrm -rf $HOME #"
    data["digest"] = content_digest(data)  # an edit that recomputes the digest
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    code, out, err = run_cli(capsys, "emit", "slurm", path)
    assert_one_line_errors(code, out, err, fragment="model.name")
    assert "rm -rf" not in out


# ---- B: every printed error line is escaped ------------------------------------------------------
def test_an_unknown_key_with_a_newline_is_escaped_in_the_error_line(capsys, tmp_path):
    job = tmp_path / "job.json"
    job.write_text(json.dumps({"cluster": "dgx-h100", "model": "llama3-8b", "training": {"global_batch": 64},
                               "x\n::error::pwned": 1}))
    lines = assert_one_line_errors(*run_cli(capsys, "check", job), fragment="unknown field")
    assert "x\\n::error::pwned" in lines[0]


@pytest.mark.parametrize("model", ["nonexist\n::error::y.yaml", "nonexist\n::error::y", "dir\x1b]0;title\x07/m.yaml"])
def test_a_path_with_control_characters_is_escaped_in_the_error_line(capsys, model):
    assert_one_line_errors(*run_cli(capsys, "estimate", "-c", "dgx-h100", "-m", model), fragment=model[:3])


def test_an_os_error_line_is_escaped(capsys, tmp_path):
    missing = tmp_path / "no\n::error::folder" / "plan.json"
    code, out, err = run_cli(capsys, "recommend", "-c", "local-cpu", "-m", "tiny-gpt", "--global-batch", "16",
                             "--out", missing)
    assert_one_line_errors(code, out, err, fragment="no\\n::error::folder")


# ---- C: only regular files of a stated size are read ---------------------------------------------
def plan3d(*args, timeout: float = 30) -> subprocess.CompletedProcess:
    """plan3d in a child process, so a reader that blocks fails the test instead of hanging it."""
    return subprocess.run([sys.executable, "-m", "plan3d", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout)


def test_a_fifo_for_a_spec_is_refused_without_waiting(tmp_path):
    fifo = tmp_path / "cluster.yaml"
    os.mkfifo(fifo)
    done = plan3d("estimate", "-c", fifo, "-m", "tiny-gpt")
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert "FIFO" in done.stderr and "not a regular file" in done.stderr


def test_a_spec_larger_than_the_limit_is_refused_before_reading(capsys, tmp_path):
    MAX_SPEC_BYTES = 16 * 2**20  # docs/specs.md, "Strict reading"
    big = tmp_path / "model.yaml"
    with big.open("wb") as f:  # sparse: no 16 MiB written
        f.truncate(MAX_SPEC_BYTES + 1)
    lines = assert_one_line_errors(*run_cli(capsys, "specs", "show", big, "--kind", "model"), fragment="16 MiB")
    assert str(big) in lines[0]


@pytest.mark.parametrize("command", [["check"], ["emit", "slurm"], ["import-hf"]])
def test_a_fifo_job_file_plan_or_config_is_refused(tmp_path, command):
    fifo = tmp_path / "file.json"
    os.mkfifo(fifo)
    done = plan3d(*command, fifo)
    assert done.returncode == 2 and done.stderr.startswith("error: ") and "FIFO" in done.stderr, done.stderr


@pytest.mark.parametrize("name", ["summary.json", "metrics.jsonl", "segments.jsonl", "plan.json"])
def test_a_fifo_in_a_run_directory_is_refused_without_waiting(tmp_path, name):
    cluster, model = load_cluster("local-cpu"), load_model("tiny-gpt")
    plan = build_plan(cluster, model, TrainingSpec(global_batch=16), Layout(tp=2, pp=2, dp=2))
    save_plan(plan, tmp_path / "plan.json")
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "step_time_s": 1.0}) + "\n")
    (tmp_path / name).unlink(missing_ok=True)
    os.mkfifo(tmp_path / name)
    done = plan3d("report", tmp_path)
    assert done.returncode == 2 and "FIFO" in done.stderr and name in done.stderr, done.stderr
