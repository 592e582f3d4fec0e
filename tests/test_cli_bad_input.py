"""Bad command-line input: one `error:` line, exit 2, never a traceback or an internal error."""
from __future__ import annotations

import pytest

from cli_helpers import run_cli  # noqa: E402


run = run_cli


def assert_one_error_line(code: int, err: str, *words: str) -> None:
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "internal error" not in err and all(w in err for w in words), err


@pytest.mark.parametrize("args, word", [
    (["estimate", "-c", "dgx-h100"], "--model"),  # missing option
    (["estimate", "-c", "dgx-h100", "-m", "tiny-gpt", "--tp", "abc"], "--tp"),  # not an integer
    (["rankmap", "--bogus"], "--bogus"),  # unknown option
    (["frobnicate"], "frobnicate"),  # unknown command
])
def test_usage_errors_are_one_line(capsys, args, word):
    code, _, err = run(capsys, *args)
    assert_one_error_line(code, err, word, "--help")


@pytest.mark.parametrize("target", ["missing/plan.json", "."])
def test_recommend_out_unwritable_is_one_line_and_leaves_no_tmp(capsys, tmp_path, target):
    out = tmp_path / target
    code, _, err = run(capsys, "recommend", "-c", "local-cpu", "-m", "tiny-gpt", "--out", str(out))
    assert_one_error_line(code, err, str(out.resolve() if target == "." else out).rstrip("/."))
    assert ".tmp" not in err and not list(tmp_path.rglob("*.tmp"))


@pytest.mark.parametrize("flag, value", [("--top", "0"), ("--top", "-2"), ("--max-pp", "0"), ("--min-tp", "0"),
                                         ("--max-vpp", "0"), ("--min-nodes", "0"),
                                         ("--tokens", "nan"), ("--tokens", "-5")])
def test_recommend_rejects_counts_below_one(capsys, flag, value):
    code, _, err = run(capsys, "recommend", "-c", "local-cpu", "-m", "tiny-gpt", flag, value)
    assert_one_error_line(code, err, flag)


@pytest.mark.parametrize("flag", ["--tp", "--pp"])
def test_explain_zero_degree_is_bad_input(capsys, flag):
    code, _, err = run(capsys, "explain", "-c", "local-cpu", "-m", "tiny-gpt", flag, "0")
    assert_one_error_line(code, err, flag.strip("-"))


@pytest.mark.parametrize("args, word", [(["--steps", "0"], "--steps"), (["--steps", "-3"], "--steps"),
                                        (["--node-rank", "-1"], "--node-rank"), (["--backend", "foo"], "--backend"),
                                        (["--master-port", "70000"], "--master-port"), (["--resume"], "--run-dir"),
                                        (["--resume-from", "/no/such/run"], "--resume-from")])
def test_launch_dry_run_rejects_nonsense_flags(capsys, args, word):
    code, out, err = run(capsys, "launch", "--dry-run", *args)
    assert_one_error_line(code, err, word)
    assert out == ""


def test_specs_show_a_model_file_is_read_as_a_model(capsys, tmp_path):
    model = tmp_path / "mine.yaml"
    model.write_text("name: mine\nlayers: 2\nhidden: 64\nheads: 4\nvocab: 128\nseq_len: 32\n")
    code, out, err = run(capsys, "specs", "show", str(model), "--json")
    assert code == 0, err
    assert '"layers": 2' in out


def test_specs_show_a_broken_model_file_reports_model_fields(capsys, tmp_path):
    model = tmp_path / "mine.yaml"
    model.write_text("name: mine\nlayers: 2\nhiden: 64\nheads: 4\nvocab: 128\nseq_len: 32\n")
    code, _, err = run(capsys, "specs", "show", str(model))
    assert code == 2 and "did you mean 'hidden'" in err and "network" not in err, err


def test_job_with_a_bad_inline_cluster_names_fields_not_validators(capsys, tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text("cluster: {name: x, nodes: 1, gpus_per_node: 8, gpu: a100-80gb}\nmodel: tiny-gpt\n"
                   "training: {global_batch: 8}\n")
    code, _, err = run(capsys, "check", str(job))
    assert code == 2 and "cluster.network" in err and "function-" not in err, err


@pytest.mark.parametrize("override", [{"hidden_size": "big"}, {"num_attention_heads": 0},
                                      {"hidden_act": ["silu"]}])
def test_import_hf_wrong_types_are_bad_input(capsys, tmp_path, override):
    import json

    config = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4,
              "num_hidden_layers": 2, "vocab_size": 1000, "max_position_embeddings": 128, **override}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    code, _, err = run(capsys, "import-hf", str(path))
    assert code == 2 and "internal error" not in err, err


def test_calibrate_nonsense_flags_are_refused_before_any_rank_starts(capsys, monkeypatch, tmp_path):
    import plan3d.cli.calibrate_cmd as calibrate_cmd

    def must_not_run(*args, **kwargs):
        raise AssertionError("the sweep started")

    monkeypatch.setattr(calibrate_cmd, "_measure", must_not_run)
    monkeypatch.chdir(tmp_path)
    for args in (["--nproc", "0"], ["--max-bytes", "0"], ["--repeats", "0"], ["--tp", "0"],
                 ["--nnodes", "2", "--node-rank", "2"], ["--statistic", "mean"]):
        code, _, err = run(capsys, "calibrate", "--backend", "gloo", *args)
        assert_one_error_line(code, err, args[-2])
    assert not list(tmp_path.iterdir())  # no empty runs/calibrate-* left behind


def test_report_survives_a_run_killed_mid_write(capsys, tmp_path):
    from plan3d.cost.estimate import estimate
    from plan3d.layout import Layout
    from plan3d.plan import build_plan, save_plan
    from plan3d.specs.catalog import load_cluster, load_model
    from plan3d.specs.training import TrainingSpec

    cluster, model, training = load_cluster("local-cpu", 1, 1), load_model("tiny-gpt"), TrainingSpec(global_batch=4)
    layout = Layout()
    save_plan(build_plan(cluster, model, training, layout, estimate(cluster, model, training, layout).to_dict()),
              tmp_path / "plan.json")
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "step_time_s": 0.5}\n{"step": 2, "step_time_s": 0.3}\n{"st')
    (tmp_path / "summary.json").write_text('{"step_time_s":')
    code, out, err = run(capsys, "report", str(tmp_path), "--json")
    assert code == 0, err
    import json

    step = next(r for r in json.loads(out)["rows"] if r["term"] == "step time")
    assert step["measured"] == pytest.approx(0.3)


def test_recommend_with_a_tp_that_divides_nothing_names_no_empty_reasons(capsys):
    code, _, err = run(capsys, "recommend", "-c", "local-cpu", "-m", "tiny-gpt", "--tp", "3")
    assert code == 1 and "()" not in err and "heads" in err, err


def test_check_without_layout_blames_the_threshold_that_rules_everything_out(capsys, tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text("cluster: local-cpu\nmodel: tiny-gpt\ntraining: {global_batch: 8}\n")
    code, out, _ = run(capsys, "check", str(job), "--min-mfu", "0.99")
    assert code == 1 and "error: " in out and "--min-mfu" in out, out


def test_ctrl_c_outside_launch_exits_130(monkeypatch, capsys):
    """Ctrl-C in any command ends it with the conventional 130, not a traceback or exit 1."""
    import plan3d.cli.specs_cmd as specs_cmd
    from plan3d.cli import main as cli_main

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(specs_cmd, "_load_any", interrupted)
    with pytest.raises(SystemExit) as info:
        cli_main(["specs", "show", "gpt3-175b"])
    assert info.value.code == 130 and "Traceback" not in capsys.readouterr().err
