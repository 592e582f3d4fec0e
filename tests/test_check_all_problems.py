"""`plan3d check` reports every problem of a job file in one run, each once, at its line (issue 30)."""
import json
import re

import pytest

from cli_helpers import run_cli
from plan3d.job import InvalidJob, load_job, read_job
from plan3d.specs.loader import key_lines, read_mapping, read_mapping_with_lines

# Four mistakes in four sections: an inline cluster's misspelt tier field, an unknown model name,
# a misspelt training key (global_batch, which is required) and a misspelt layout key.
TYPOS = """\
# a job with a mistake in each section
cluster:
  name: mine
  nodes: 2
  gpus_per_node: 8
  gpu: h100-sxm
  network:
    - name: nvlink4
      bandwidth: {gbytes_per_s_per_gpu: 900, bidirectional: true}
      latency_us: 3
      efficency: 0.8
    - name: ib
      bandwidth: {gbit_per_s_per_nic: 400, nics_per_node: 8}
      latency_us: 8
model: llama3-8bb
training:
  precision: bf16
  global_bach: 64
layout:
  tp: 2
  micro_bach: 1
"""
# field -> (the key whose line the problem is at, a fragment of its message)
EXPECTED = {
    "cluster.network.0.efficency": ("efficency:", "did you mean 'efficiency'"),
    "model": ("model:", "unknown model 'llama3-8bb'"),
    "training.global_bach": ("global_bach:", "did you mean 'global_batch'"),
    "layout.micro_bach": ("micro_bach:", "did you mean 'micro_batch'"),
}


def line_of(text: str, key: str) -> int:
    """The 1-based line of the one line of `text` that holds `key`."""
    lines = [n for n, line in enumerate(text.splitlines(), 1) if key in line]
    assert len(lines) == 1, (key, lines)
    return lines[0]


@pytest.fixture
def typos(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text(TYPOS)
    return path


def test_every_section_is_reported_in_one_run_with_exit_2(capsys, typos):
    code, out, err = run_cli(capsys, "check", typos)
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert all(line.startswith("error: ") for line in lines) and "Traceback" not in err
    for field, (key, fragment) in EXPECTED.items():
        mine = [line for line in lines if f": {field}: " in line]
        assert len(mine) == 1 and fragment in mine[0], (field, lines)
        assert mine[0].startswith(f"error: {typos}:{line_of(TYPOS, key)}: "), mine[0]
    assert len(lines) == len(EXPECTED) + 1 and "4 problems" in lines[-1]  # and one summary line


def test_a_misspelt_required_key_is_one_problem_not_two(capsys, typos):
    _, _, err = run_cli(capsys, "check", typos)
    assert "training.global_batch" not in err and "(it is required)" in err


def test_github_annotations_carry_file_line_and_field_once_each(capsys, typos):
    code, out, err = run_cli(capsys, "check", typos, "--format", "github")
    assert code == 2
    annotations = out.strip().splitlines()
    assert len(annotations) == len(EXPECTED) and all(a.startswith("::error file=") for a in annotations)
    for field, (key, fragment) in EXPECTED.items():
        prefix = f"::error file={typos},line={line_of(TYPOS, key)},title=plan3d check%3A {field}::"
        assert sum(a.startswith(prefix) for a in annotations) == 1, (prefix, annotations)
    for _, fragment in EXPECTED.values():  # each problem printed once: not again as a plain line
        assert (out + err).count(fragment) == 1, fragment
    assert len(err.strip().splitlines()) == 1 and err.startswith("error: ") and "4 problems" in err


def test_json_lists_every_problem_with_field_and_line(capsys, typos):
    code, out, err = run_cli(capsys, "check", typos, "--json")
    data = json.loads(out)
    assert code == 2 and data["valid"] is False and data["ok"] is False
    found = {f["field"]: f for f in data["findings"]}
    assert set(found) == set(EXPECTED)
    for field, (key, fragment) in EXPECTED.items():
        assert found[field]["line"] == line_of(TYPOS, key) and fragment in found[field]["message"]
        assert found[field]["level"] == "error"
    assert len(err.strip().splitlines()) == 1


def test_a_phase_that_needs_a_broken_part_is_skipped_not_guessed(capsys, tmp_path):
    """tp=5 cannot split gpt3-175b's 96 heads, but with the model name misspelt nothing knows the
    heads: only the model is reported (and no engine default is guessed without it)."""
    path = tmp_path / "job.yaml"
    path.write_text("cluster: dgx-a100-80g\nnodes: 64\nmodel: gpt3-175bb\ntraining: {global_batch: 1536}\n"
                    "layout: {tp: 5, pp: 7, dp: 4, micro_batch: 1}\n")
    code, out, err = run_cli(capsys, "check", path, "--json")
    findings = json.loads(out)["findings"]
    assert code == 2 and [f["field"] for f in findings] == ["model"] and findings[0]["line"] == 3
    assert "tp=5" not in out + err and "engine" not in out


def test_missing_fields_point_at_their_parent_or_line_1(capsys, tmp_path):
    text = "# no model\ncluster: dgx-h100\nnodes: 1\ntraining:\n  precision: bf16\n"
    path = tmp_path / "job.yaml"
    path.write_text(text)
    code, out, _ = run_cli(capsys, "check", path, "--format", "github")
    assert code == 2
    assert f"::error file={path},line=1,title=plan3d check%3A model::missing; add `model:`" in out
    assert (f"::error file={path},line={line_of(text, 'training:')},title=plan3d check%3A training.global_batch::"
            "missing; add `global_batch:` under `training:`") in out


def test_size_overrides_and_cluster_name_are_checked_apart(capsys, tmp_path):
    text = 'cluster: dgx-h10\nnodes: "2"\nmodel: llama3-8b\ntraining: {global_batch: 64}\nlayout: {tp: 0}\n'
    path = tmp_path / "job.yaml"
    path.write_text(text)
    code, out, _ = run_cli(capsys, "check", path, "--json")
    found = {f["field"]: f["line"] for f in json.loads(out)["findings"]}
    assert code == 2 and found == {"cluster": 1, "nodes": 2, "layout.tp": 5}, found


def test_an_unknown_gpu_in_an_inline_cluster_hides_nothing_else(capsys, tmp_path):
    text = TYPOS.replace("gpu: h100-sxm", "gpu: h100-sxmm").replace("efficency", "efficiency")
    path = tmp_path / "job.yaml"
    path.write_text(text)
    code, out, _ = run_cli(capsys, "check", path, "--json")
    found = {f["field"]: f for f in json.loads(out)["findings"]}
    assert code == 2 and set(found) == {"cluster.gpu", "model", "training.global_bach", "layout.micro_bach"}
    assert found["cluster.gpu"]["line"] == line_of(text, "  gpu: ") and "h100-sxmm" in found["cluster.gpu"]["message"]


def test_a_json_job_gets_lines_too(capsys, tmp_path):
    data = {"cluster": "dgx-h100", "model": "llama3-8b", "training": {"global_batch": 64, "precison": "bf16"},
            "layout": {"tp": 2, "pipeline": 2}}
    text = json.dumps(data, indent=2)
    path = tmp_path / "job.json"
    path.write_text(text)
    code, out, _ = run_cli(capsys, "check", path, "--format", "github")
    assert code == 2
    assert f"::error file={path},line={line_of(text, 'precison')},title=plan3d check%3A training.precison::" in out
    assert f"::error file={path},line={line_of(text, 'pipeline')},title=plan3d check%3A layout.pipeline::" in out


def test_a_file_that_does_not_parse_is_one_problem_at_the_parsers_line(capsys, tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("cluster: dgx-h100\nmodel: llama3-8b\ntraining: {global_batch: 64\nlayout: {tp: 2}\n")
    code, out, err = run_cli(capsys, "check", path, "--format", "github")
    annotations = out.strip().splitlines()
    assert code == 2 and len(annotations) == 1 and "not valid YAML at line" in annotations[0]
    parser_line = re.search(r"at line (\d+)", annotations[0]).group(1)
    assert annotations[0].startswith(f"::error file={path},line={parser_line},title=plan3d check::")
    assert len(err.strip().splitlines()) == 1


def test_a_valid_job_still_passes(capsys):
    code, out, err = run_cli(capsys, "check", "examples/jobs/gpt3-175b-seed.yaml", "--format", "github")
    assert code == 0, out + err
    assert out.startswith("PASS") and "::error" not in out and err == ""
    assert len([line for line in out.splitlines() if not line.startswith("::")]) == 1  # one verdict line


def test_a_job_that_does_not_fit_still_exits_1_with_lines(capsys):
    path = "examples/jobs/llama3-405b-too-small.yaml"
    code, out, _ = run_cli(capsys, "check", path, "--format", "github")
    with open(path) as f:
        layout = line_of(f.read(), "layout:")
    assert code == 1 and out.startswith("FAIL")
    errors = [line for line in out.splitlines() if line.startswith("::error")]
    assert errors and all(line.startswith(f"::error file={path},line=") for line in errors)
    assert any(f",line={layout},title=plan3d check%3A layout::" in line and "exceeds" in line for line in errors)


def test_a_layout_finding_points_at_its_field(capsys, tmp_path):
    text = ("cluster: dgx-a100-80g\nnodes: 64\nmodel: gpt3-175b\ntraining: {global_batch: 1536}\n"
            "layout:\n  tp: 5\n  pp: 8\n  dp: 8\n  micro_batch: 1\n")
    path = tmp_path / "job.yaml"
    path.write_text(text)
    code, out, _ = run_cli(capsys, "check", path, "--format", "github")
    heads = [line for line in out.splitlines() if "does not divide 96 heads" in line]
    assert code == 1 and len(heads) == 1
    assert heads[0].startswith(f"::error file={path},line={line_of(text, 'tp:')},title=plan3d check%3A layout.tp::")
    data = json.loads(run_cli(capsys, "check", path, "--json")[1])
    assert [f["line"] for f in data["findings"] if "96 heads" in f["message"]] == [line_of(text, "tp:")]


def test_load_job_raises_every_problem_at_once(typos):
    with pytest.raises(InvalidJob) as raised:
        load_job(str(typos))
    assert [p.field for p in raised.value.job_problems] == list(EXPECTED)  # in file order
    assert read_job(str(typos)).job is None


def test_key_lines_block_flow_lists_merges_and_json():
    text = "a:\n  b: 1\n  c: [1,\n    2]\nbase: &b {x: 1, y: 2}\nd:\n  <<: *b\n  y: 3\ne:\n  - {f: 1}\n  - f: 2\n"
    lines = key_lines(text)
    assert lines["a"] == 1 and lines["a.b"] == 2 and lines["a.c"] == 3 and lines["a.c.1"] == 4
    assert lines["d.y"] == 8 and lines["d.x"] == 7  # a merged key: the line of its `<<`
    assert lines["e.0.f"] == 10 and lines["e.1.f"] == 11
    assert key_lines('{\n  "a": {"b":\n 1}\n}') == {"a": 2, "a.b": 2}
    assert key_lines("a: [1") == {}


def test_read_mapping_with_lines_returns_what_read_mapping_does(typos):
    data, lines = read_mapping_with_lines(typos)
    assert data == read_mapping(typos) and lines["layout.micro_bach"] == line_of(TYPOS, "micro_bach:")
