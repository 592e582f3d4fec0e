"""`plan3d check JOB.yaml`: exit 0 / 1 / 2, reasons with fixes, GitHub annotations, JSON."""
import json
from pathlib import Path


from cli_helpers import run_cli  # noqa: E402

JOBS = Path(__file__).resolve().parent.parent / "examples" / "jobs"


def run(capsys, *args):
    return run_cli(capsys, "check", *args)


def write(tmp_path, text: str) -> Path:
    path = tmp_path / "job.yaml"
    path.write_text(text)
    return path


SEED = JOBS / "gpt3-175b-seed.yaml"


def test_seed_job_passes(capsys):
    code, out, err = run(capsys, SEED)
    assert code == 0, out + err
    assert out.startswith("PASS") and "tokens/s" in out


def test_bad_layout_fails_with_each_reason_and_fix(capsys):
    code, out, _ = run(capsys, JOBS / "gpt3-175b-bad-layout.yaml")
    assert code == 1 and out.startswith("FAIL")
    assert "tp=5 does not divide 96 heads" in out and "micro-batch 5 does not divide the per-replica batch 128" in out
    assert out.count("fix:") >= 2 and "recommended for this job" in out


def test_job_that_does_not_fit_fails_with_changes_and_nodes(capsys):
    code, out, _ = run(capsys, JOBS / "llama3-405b-too-small.yaml")
    assert code == 1
    assert "exceeds the" in out and "GiB usable" in out and "use nodes:" in out


def test_invalid_file_exits_2_per_field(capsys):
    code, out, err = run(capsys, JOBS / "invalid.yaml")
    assert code == 2
    assert "micro_bach" in err and "layout.zero" in err


def test_missing_file_exits_2(capsys, tmp_path):
    code, _, err = run(capsys, tmp_path / "nope.yaml")
    assert code == 2 and err.startswith("error:")


def test_github_format_annotates_each_error(capsys):
    code, out, _ = run(capsys, JOBS / "gpt3-175b-bad-layout.yaml", "--format", "github")
    assert code == 1
    errors = [line for line in out.splitlines() if line.startswith("::error file=")]
    assert len(errors) >= 2
    line = next(n for n, text in enumerate((JOBS / "gpt3-175b-bad-layout.yaml").read_text().splitlines(), 1)
                if text.startswith("layout:"))  # a flow mapping: every layout field is on that line
    assert all(f"gpt3-175b-bad-layout.yaml,line={line},title=plan3d check%3A layout" in e for e in errors)


def test_github_format_for_an_invalid_file(capsys):
    code, out, _ = run(capsys, JOBS / "invalid.yaml", "--format", "github")
    assert code == 2 and out.startswith("::error file=")


def test_json_verdict(capsys):
    code, out, _ = run(capsys, SEED, "--json")
    data = json.loads(out)
    assert code == 0 and data["schema_version"] == 1 and data["ok"] and data["valid"]
    assert data["estimate"]["fits"] and data["estimate"]["peak_memory_bytes"] <= data["estimate"]["capacity_bytes"]


def test_thresholds_fail_a_fitting_job(capsys):
    code, out, _ = run(capsys, SEED, "--json")
    est = json.loads(out)["estimate"]
    code, out, _ = run(capsys, SEED, "--min-mfu", f"{min(est['mfu'] + 0.01, 1):.4f}")
    assert code == 1 and "--min-mfu" in out
    from plan3d.specs.catalog import load_cluster

    fraction = est["peak_memory_bytes"] / load_cluster("dgx-a100-80g").gpu.memory_bytes * 0.9
    code, out, _ = run(capsys, SEED, "--max-memory-fraction", f"{fraction:.4f}")
    assert code == 1 and "--max-memory-fraction" in out


def test_job_without_layout_passes_when_some_layout_fits(capsys, tmp_path):
    path = write(tmp_path, "cluster: dgx-a100-80g\nnodes: 2\nmodel: llama3-8b\ntraining: {global_batch: 64}\n")
    code, out, _ = run(capsys, path)
    assert code == 0 and "recommended for this job" in out


def test_unknown_format_exits_2(capsys):
    code, _, err = run(capsys, SEED, "--format", "gitlab")
    assert code == 2 and "--format" in err


HALF_USED = """cluster: dgx-a100-80g
nodes: 64
model: gpt3-175b
training: {global_batch: 1536, precision: bf16}
layout: {tp: 8, pp: 8, dp: 4, micro_batch: 1, zero: 1, recompute: selective, sequence_parallel: true}
"""


def test_idle_gpus_warn_once_and_fail_under_strict(capsys, tmp_path):
    job = write(tmp_path, HALF_USED)
    code, out, _ = run(capsys, job)
    assert code == 0 and out.count("256 of the cluster's 512 GPUs") == 1
    code, out, _ = run(capsys, job, "--strict", "--format", "github")
    assert code == 1 and out.startswith("FAIL")
    assert sum(line.startswith("::error") and "256 idle" in line for line in out.splitlines()) == 1
    data = json.loads(run(capsys, job, "--strict", "--json")[1])
    assert data["ok"] is False and [f["level"] for f in data["findings"] if "idle" in f["message"]] == ["error"]


def test_strict_passes_a_job_that_uses_every_gpu(capsys):
    code, out, err = run(capsys, SEED, "--strict")
    assert code == 0, out + err
